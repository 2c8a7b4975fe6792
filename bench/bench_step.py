"""One training step (forward + backward, full-parameter gradients, no optimizer) of a
Qwen2.5-7B-shaped model with random bf16 weights: oomb dense vs transformers + SDPA +
gradient checkpointing, and + Liger kernels when importable. Each implementation runs in its
own process (clean peak-memory counters), one after the other in the same command.

    python bench/bench_step.py --impls oomb,liger,hf --lengths 32K,64K,128K,256K

Prints and appends one JSON line per (impl, length) to --out: step seconds, tokens/s, peak GPU
memory, and the oomb memory plan for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import append_results, run_info  # noqa: E402

from oomb.cli import parse_tokens  # noqa: E402


def build(layers: int, liger: bool):
    from oomb.presets import load_model

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    torch.manual_seed(0)
    model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=layers)
    model.config._attn_implementation = "sdpa"
    model.train()
    return model


GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OOMB_OFFLOAD = {"oomb": "none", "oomb-all": "all", "oomb-auto": "auto", "oomb-sparse": "none",
                "oomb-sparse-all": "all", "oomb-sparse-auto": "auto"}


def step_fn(impl: str, model, chunk_size: int, kv_grad_dtype: str = "fp32"):
    if impl in OOMB_OFFLOAD:
        import oomb

        sparse = oomb.TopKPages(budget=64) if "sparse" in impl else None
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=chunk_size, page_size=128, backend="triton",
                                           offload=OOMB_OFFLOAD[impl], sparse=sparse,
                                           kv_grad_dtype=GRAD_DTYPES[kv_grad_dtype])
        return lambda ids: engine.forward_backward(ids).loss
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def hf_step(ids):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss
    return hf_step


def worker(args) -> None:
    info = run_info()
    model = build(args.layers, args.impl == "liger")
    step = step_fn(args.impl, model, args.chunk_size, args.kv_grad_dtype)
    vocab = model.config.vocab_size
    weights_gib = torch.cuda.memory_allocated() / 2**30
    step(torch.randint(0, vocab, (1, 8192), device="cuda"))  # warm-up: kernels compiled, grads allocated
    for length in args.lengths:
        ids = torch.randint(0, vocab, (1, length), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        row = {"bench": "step", "impl": args.impl, "seq_len": length, "layers": args.layers,
               "chunk_size": args.chunk_size if args.impl in OOMB_OFFLOAD else None,
               "kv_grad_dtype": args.kv_grad_dtype if args.impl in OOMB_OFFLOAD else None, "weights_gib": round(weights_gib, 2)}
        try:
            loss = float(step(ids))
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            row.update(ok=True, step_s=round(dt, 2), tok_s=round(length / dt, 1), loss=round(loss, 4),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                       host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1))
        except torch.OutOfMemoryError as e:
            row.update(ok=False, error=str(e)[:160])
        row.update(info)
        print(json.dumps(row), flush=True)
        append_results(args.out, [row])  # row by row: a run cut short keeps what it measured
        for p in model.parameters():
            p.grad = None
        torch.cuda.empty_cache()
        if not row["ok"]:
            break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="oomb,liger,hf",
                    help="oomb, oomb-all, oomb-auto (offload modes), oomb-sparse[-all|-auto] (TopKPages(64)), liger, hf")
    ap.add_argument("--lengths", default="32K,64K,128K,256K")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step.jsonl"))
    ap.add_argument("--kv-grad-dtype", choices=sorted(GRAD_DTYPES), default="fp32", help="oomb's dK/dV pages")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per implementation")
    ap.add_argument("--impl", help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args()
    args.lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench_step.py needs a CUDA GPU")
    if args.impl:
        return worker(args)
    for impl in args.impls.split(","):
        cmd = [sys.executable, __file__, "--impl", impl, "--lengths", ",".join(map(str, args.lengths)),
               "--layers", str(args.layers), "--chunk-size", str(args.chunk_size), "--out", args.out,
               "--kv-grad-dtype", args.kv_grad_dtype]
        try:
            subprocess.run(cmd, timeout=args.timeout)  # the worker prints and appends its rows
        except subprocess.TimeoutExpired:
            print(json.dumps({"bench": "step", "impl": impl, "ok": False, "error": f"timeout {args.timeout}s"}),
                  flush=True)


if __name__ == "__main__":
    main()
