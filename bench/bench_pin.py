"""How fast host memory is pinned, and how much it takes (GPU machine): torch's pinned allocator
(`torch.empty(..., pin_memory=True)`: cudaHostAlloc, or malloc + cudaHostRegister on N threads
with PYTORCH_CUDA_ALLOC_CONF's pinned_use_cuda_host_register) against oomb's empty_pinned (its
pages touched on several threads, then registered: memory/pinned.py). Each variant runs in its
own process (a fresh address space and allocator). Blocks of 1 GiB, as many as --gib, plus one
of 1.5 GiB: the host memory each variant then holds (resident set) shows any rounding.

Why: a 1M-token step pins ~150-200 GiB before its first step (page arena, kept attention
outputs); at torch's ~1.3-2.3 GB/s that took 115-146 s.

    python bench/bench_pin.py --gib 16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

GIB = 2**30
REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:{}"
VARIANTS = {"torch": None, "torch-register8": REGISTER.format(8), "torch-register16": REGISTER.format(16),
            "oomb": None}


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def worker(variant: str, gib: int, out: str) -> None:
    from oomb.memory.pinned import empty_pinned, touch_threads

    torch.zeros(1, device="cuda")  # the CUDA context first: not part of the timing
    before = rss_gib()
    sizes = [GIB] * gib + [3 * GIB // 2]
    t0 = time.perf_counter()
    if variant == "oomb":
        blocks = [empty_pinned((n,), torch.uint8) for n in sizes]
    else:
        blocks = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
    seconds = time.perf_counter() - t0
    assert all(b.is_pinned() for b in blocks)
    src = torch.randint(0, 255, (GIB,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    blocks[0].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    d2h = GIB / 1e9 / (time.perf_counter() - t1)
    asked = sum(sizes) / GIB
    record(out, {"bench": "pin", "variant": variant, "alloc_conf": VARIANTS[variant], "blocks": len(sizes),
                 "asked_gib": round(asked, 2), "seconds": round(seconds, 2),
                 "gb_per_s": round(sum(sizes) / 1e9 / seconds, 2), "held_gib": round(rss_gib() - before, 2),
                 "d2h_gb_per_s": round(d2h, 1), "threads": touch_threads() if variant == "oomb" else None,
                 **run_info()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=16, help="1 GiB blocks to pin (plus one of 1.5 GiB)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pin.jsonl"))
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args()
    if args.variant:
        worker(args.variant, args.gib, args.out)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_pin.py measures CUDA pinned memory: run it on the GPU machine")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if VARIANTS[variant]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = VARIANTS[variant]
        done = subprocess.run([sys.executable, __file__, "--variant", variant, "--gib", str(args.gib),
                               "--out", args.out], env=env)
        if done.returncode:
            print(json.dumps({"bench": "pin", "variant": variant, "ok": False, "returncode": done.returncode}))


if __name__ == "__main__":
    main()
