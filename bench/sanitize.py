"""compute-sanitizer (memcheck, racecheck, synccheck) on each of oomb's kernels alone, at small shapes.

    # H200 (Firecracker or bare metal; under gVisor compute-sanitizer cannot attach, as the script says):
    OOMB_COMMIT=<sha> python bench/sanitize.py --results $OUT/sanitize.jsonl --log-dir $OUT/sanitize
    python bench/sanitize.py --kernels sparse --tools racecheck            # a subset
    TRITON_INTERPRET=1 python bench/sanitize.py --kernel forward,sparse    # children alone (CPU: interpreted)

The parent checks that compute-sanitizer runs a CUDA program here, runs the children once without
it (compiling Triton's kernels into the cache the sanitized runs hit: compiling under the sanitizer
is slow; what fails or does not apply is recorded, not sanitized), then runs `compute-sanitizer
--tool T --error-exitcode 1 python bench/sanitize.py --kernel K` per kernel and tool, --jobs at once,
within --timeout each and --budget-s in all; memcheck with PyTorch's caching allocator off (an access
past a tensor then leaves its allocation). One row per (kernel, tool) in --results; each run's output
and summary.log in --log-dir. On the H200 (2026-12-02): warm-up 43 s, then 21 runs of 14-26 s, 94 s
at --jobs 8.

Kernels (a child builds small inputs, launches once, checks the results are finite): forward,
backward (Triton's dK/dV and dQ kernels, at a chunk Hopper's fused kernel does not take),
hopper-backward (that Gluon kernel, sm_90), sparse (top-k), window-sinks (GPT-OSS, head_dim 64),
gather (the zero-copy row kernel, pinned host <-> GPU), dma (the same rows by the copy
engines, memory/dma.py), and the controls for hopper-backward's racecheck reports: ws-control
(Gluon's warp specialisation alone, three partitions writing their own memory) and its variants
-bar, -mbarrier, -capture and -all, each adding what the Hopper kernel adds around it (WS_VARIANTS).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))  # this tree's oomb
import torch  # noqa: E402

from oomb.attention import paged_attention, paged_hopper, single_group  # noqa: E402
from oomb.memory.dma import batch_copier, copy_rows, row_copies  # noqa: E402
from oomb.memory.pinned import empty_pinned  # noqa: E402
from oomb.memory.spec import LayerPages  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck")
ERRORS = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACES = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


# ---- child: one kernel, small inputs ----------------------------------------------------------

class Skip(Exception):
    """The kernel does not run on this device (the message says why)."""


def case(dev, d=None, c=None, n_pages=3):
    """q (B, H, C, D), k, v (B, Hkv, C, D) as transposed views (as the engine has them), K/V pools
    with spare slots (n_slots, Hkv, P, D), fp32 gradient pools, a shuffled table (B, n_pages) int32
    and dO: the GPU's tiles (D 128, pages of 128, query tiles of 128: the second one partial) or
    the interpreter's."""
    cuda = dev.type == "cuda"
    b, h, n_kv, p = (1, 4, 2, 128) if cuda else (1, 4, 2, 16)
    c = c or (240 if cuda else 60)
    d, dtype = d or (128 if cuda else 16), torch.bfloat16 if cuda else torch.float16
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, generator=g).to(dev, dt)  # noqa: E731
    n_slots = b * n_pages + 2
    q, k, v = (rand(b, c, heads, d).transpose(1, 2) for heads in (h, n_kv, n_kv))
    pools = [rand(n_slots, n_kv, p, d) for _ in "kv"] + [rand(n_slots, n_kv, p, d, dt=torch.float32) for _ in "kv"]
    table = torch.randperm(n_slots, generator=g)[: b * n_pages].view(b, n_pages).int().to(dev)
    return q, k, v, *pools, table, rand(b, h, c, d)


def attention(dev, grad=True, sparse=False, window=False, sinks=False, d=None, c=None):
    """Paged attention over the case's pages through the autograd function (paged.forward; with
    grad paged.backward, which adds into the gradient pools). sparse: two query blocks, each
    attending 2 of the 3 pages (page 0, the sink, in both); window: over the last 1.5 pages."""
    q, k, v, kp, vp, dkp, dvp, table, do = case(dev, d, c)
    p, block = kp.shape[2], 128 if dev.type == "cuda" else 32
    picks = torch.tensor([[0, 2], [0, 1]], dtype=torch.int32, device=dev).expand(1, 2, 2, 2).contiguous()
    pages = LayerPages(kp, vp, dkp if grad else None, dvp if grad else None, table, 0, picks if sparse else None,
                       block if sparse else 0, window=p + p // 2 if window else 0, q_start=table.shape[1] * p)
    leaves = [x.detach().requires_grad_(grad) for x in (q, k, v)]
    sink = torch.randn(q.shape[1], device=dev).requires_grad_(grad) if sinks else None
    with torch.set_grad_enabled(grad):
        o = paged_attention(*leaves, single_group(pages), q.shape[-1] ** -0.5, "triton", sinks=sink)
    if grad:
        o.backward(do)
    return [o, pages.dk, pages.dv, sink] + [x.grad for x in leaves]


def backward(dev, hopper: bool):
    """Dense pages with gradients: on Hopper the Gluon kernel takes them when the chunk is a
    multiple of its 64-query tiles (256 here), the Triton kernels when not (240)."""
    if hopper and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9 or not paged_hopper.AVAILABLE):
        raise Skip("the Gluon kernel needs a sm_90 GPU and a Triton with the Gluon features it uses")
    q, _, _, kp, vp, dkp, dvp, table, _ = case(dev, c=256 if hopper else None)
    taken = paged_hopper.eligible(q, LayerPages(kp, vp, dkp, dvp, table))
    assert taken == hopper, f"these inputs take the {'Gluon' if taken else 'Triton'} path"
    return attention(dev, c=256 if hopper else None)


def round_trip(dev, move):
    """8 scattered rows of a pinned host arena (40 rows of 4 KiB) to the GPU, doubled there, and
    back, on a side stream: move(src, src_rows, dst, dst_rows, stream) with int64 CPU rows."""
    if dev.type != "cuda":
        raise Skip("moves pinned host memory to a GPU (on the CPU, offload copies by plain indexing)")
    host = empty_pinned((40, 2048), torch.bfloat16)
    host.copy_(torch.randn(40, 2048))
    rows = torch.tensor([3, 4, 5, 17, 0, 39, 21, 22])
    want, stream = host[rows].clone(), torch.cuda.Stream()
    staged = torch.empty((8, 2048), dtype=torch.bfloat16, device=dev)
    with torch.cuda.stream(stream):
        move(host, rows, staged, None, stream)
        staged.mul_(2)
        move(staged, None, host, rows, stream)
    torch.cuda.synchronize()
    assert torch.equal(host[rows], 2 * want), "the rows did not make the round trip"
    return [staged]


def gather(dev):
    cuda = lambda rows: None if rows is None else rows.to(dev)  # noqa: E731 (the kernel reads its rows on the GPU)
    return round_trip(dev, lambda src, sr, dst, dr, stream: copy_rows(src, cuda(sr), dst, cuda(dr)))


def dma(dev):
    copier = batch_copier() if dev.type == "cuda" else None
    if dev.type == "cuda" and copier is None:
        raise Skip("no batched copy here: a CUDA driver older than 12.8")
    numpy = lambda rows: None if rows is None else rows.numpy()  # noqa: E731
    return round_trip(dev, lambda src, sr, dst, dr, stream: copier(*row_copies(src, numpy(sr), dst, numpy(dr)),
                                                                   stream.cuda_stream))


# Controls for racecheck's reports on the Gluon kernel: Gluon's warp specialisation and, one at a
# time, the three things paged_hopper._fused_bwd adds around it that the bare control lacks. Triton's
# lowering hands the worker warps their start state through a word of shared memory behind a named
# barrier (barrier 1, all warps); the Hopper kernel also (a) syncs its default partition's own warps
# (barrier 0 with a thread count), (b) initialises mbarriers before the partitions start, and (c)
# hands a value computed in the kernel to a worker (a capture slot in shared memory). The bare
# control is clean under racecheck (8161183, H200); whichever variant is not names what the tool
# reacts to in the Hopper kernel, whose flagged pairs are all separated by barrier 1.
WS_VARIANTS = {"ws-control": (False, False, False), "ws-control-bar": (True, False, False),
               "ws-control-mbarrier": (False, True, False), "ws-control-capture": (False, False, True),
               "ws-control-all": (True, True, True)}  # (BAR, MBAR, CAPTURE)

if paged_hopper.AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    @gluon.jit
    def _ws_default(out, bar, BLOCK: gl.constexpr, WARPS: gl.constexpr, BAR: gl.constexpr, MBAR: gl.constexpr):
        offs = gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        if BAR:  # a first value, then a barrier of this partition's warps only, then the final one
            gl.store(out + offs, -1.0 - offs.to(gl.float32))
            paged_hopper._thread_barrier()
        gl.store(out + offs, offs.to(gl.float32))
        if MBAR:
            mbarrier.wait(bar, 0)  # worker 1's arrival

    @gluon.jit
    def _ws_worker(out, base, bar, which: gl.constexpr, BLOCK: gl.constexpr, MBAR: gl.constexpr):
        offs = gl.arange(0, BLOCK, layout=gl.BlockedLayout([1], [32], [1], [0]))
        gl.store(out + base + which * BLOCK + offs, offs.to(gl.float32) + which)
        if MBAR:
            if which == 1:
                mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _ws_control(out, Base, BLOCK: gl.constexpr, WARPS: gl.constexpr, BAR: gl.constexpr, MBAR: gl.constexpr,
                    CAPTURE: gl.constexpr):
        # as paged_hopper._fused_bwd: a default partition and two one-warp workers at 40 registers
        if MBAR:
            bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(bar, count=1)
        else:
            bar = out  # unused
        if CAPTURE:
            base = gl.load(Base)  # computed in the kernel (0): reaches the workers through shared memory
        else:
            base = 0
        gl.warp_specialize([(_ws_default, (out, bar, BLOCK, WARPS, BAR, MBAR)),
                            (_ws_worker, (out, base, bar, 1, BLOCK, MBAR)),
                            (_ws_worker, (out, base, bar, 2, BLOCK, MBAR))], [1, 1], [40, 40])


def ws_control(dev, variant: str = "ws-control"):
    """Three partitions each write their own 256 floats: i + p for partition p (WS_VARIANTS)."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9 or not paged_hopper.AVAILABLE:
        raise Skip("Gluon's warp specialisation as the Hopper kernel uses it needs a sm_90 GPU and its Triton features")
    bar, mbar, capture = WS_VARIANTS[variant]
    out = torch.full((3 * 256,), -1.0, device=dev)
    base = torch.zeros(1, dtype=torch.int32, device=dev)
    _ws_control[(1,)](out, base, BLOCK=256, WARPS=8, BAR=bar, MBAR=mbar, CAPTURE=capture, num_warps=8)
    torch.cuda.synchronize()
    want = torch.arange(256, device=dev, dtype=torch.float32).repeat(3) + torch.arange(3, device=dev).repeat_interleave(256)
    assert torch.equal(out, want), "a partition's stores are missing"
    return [out]


KERNELS = {"forward": lambda dev: attention(dev, grad=False), "backward": lambda dev: backward(dev, hopper=False),
           "hopper-backward": lambda dev: backward(dev, hopper=True), "sparse": lambda dev: attention(dev, sparse=True),
           "window-sinks": lambda dev: attention(dev, window=True, sinks=True, d=64),  # GPT-OSS's sliding layers
           "gather": gather, "dma": dma,
           **{name: partial(ws_control, variant=name) for name in WS_VARIANTS}}


def child(names: list[str]) -> int:
    """Each kernel once, a line each: "sanitize: NAME ok|skipped: why|FAILED"; exit 1 if any failed."""
    dev, failed = torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    for name in names:
        t0 = time.perf_counter()
        try:
            outs = KERNELS[name](dev)
            assert all(torch.isfinite(x).all() for x in outs if x is not None), "a result is not finite"
            print(f"sanitize: {name} ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Skip as e:
            print(f"sanitize: {name} skipped: {e}", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"sanitize: {name} FAILED", flush=True)
            failed = True
    return int(failed)


# ---- parent: every kernel under every tool ----------------------------------------------------

def parse(output: str) -> dict:
    """errors (None: no summary, the sanitizer did not finish), racecheck's hazards and warnings,
    the summary lines, and how many API errors it reported ("Program hit ...")."""
    out = {"errors": None, "summary": None, "api_errors": output.count("Program hit")}
    race, errors = RACES.search(output), ERRORS.search(output)
    if race:
        out.update(errors=int(race[2]), hazards=int(race[1]), warnings=int(race[3]))
    if errors:
        out["errors"] = max(out["errors"] or 0, int(errors[1]))
    lines = [output[output.rfind("\n", 0, m.start()) + 1 : m.end()].strip(" =") for m in (race, errors) if m]
    out["summary"] = "; ".join(lines) or None
    return out


def execute(cmd: list[str], timeout: float, env: dict) -> tuple[int | None, str, float]:
    """(exit code, or None past the timeout; stdout + stderr; seconds). Past the timeout its whole
    process group is killed: the sanitizer's target too, which a kill of the sanitizer leaves running."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out = p.communicate(timeout=timeout)[0]
        return p.returncode, out, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        return None, p.communicate()[0], time.perf_counter() - t0


def sanitizer_unusable(env: dict) -> str | None:
    """None when compute-sanitizer runs a CUDA program here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU here (on a CPU, run the children under TRITON_INTERPRET=1: --kernel NAME)"
    if shutil.which("compute-sanitizer") is None:
        return "compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)"
    probe = "import torch; torch.ones(8, device='cuda').add_(1); torch.cuda.synchronize()"
    rc, out, _ = execute(["compute-sanitizer", "--tool", "memcheck", sys.executable, "-c", probe], 180, env)
    if rc == 0 and ERRORS.search(out):
        return None
    said = [line.strip(" =") for line in out.splitlines() if "rror" in line][:2] or out.strip().splitlines()[-1:]
    return (f"compute-sanitizer could not run a CUDA program here (exit {rc}: {' | '.join(said)}); under gVisor "
            "it cannot attach to the GPU: run this on a Firecracker VM or bare metal")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", help="child mode: run these kernels (comma-separated) once, no sanitizer")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--jobs", type=int, default=8, help="sanitized runs at once (they share the GPU)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per sanitized run")
    ap.add_argument("--budget-s", type=float, default=420, help="no run starts after this many seconds")
    ap.add_argument("--results", default=os.path.join(HERE, "results", "sanitize.jsonl"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "runs", "sanitize"))
    args = ap.parse_args()
    if args.kernel:
        return child(args.kernel.split(","))

    sys.path.insert(0, HERE)
    from common import record, run_info

    start, info = time.time(), run_info()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    row = lambda kernel, tool, status, **more: {"bench": "sanitize", "kernel": kernel, "tool": tool,  # noqa: E731
                                                 "status": status, **more, **info}
    why = sanitizer_unusable(env)
    if why:
        print(f"sanitize: {why}", file=sys.stderr)
        record(args.results, row(None, None, "unavailable", summary=why))
        return 2
    kernels, tools = args.kernels.split(","), args.tools.split(",")
    os.makedirs(args.log_dir, exist_ok=True)
    # Warm-up without the sanitizer: every kernel compiled into Triton's cache; what fails or does not apply, dropped.
    _, out, _ = execute([sys.executable, __file__, "--kernel", ",".join(kernels)], args.budget_s, env)
    print(out[-3000:], flush=True)
    runs = []
    for kernel in kernels:
        said = [x for x in out.splitlines() if x.startswith(f"sanitize: {kernel} ")]
        line = said[-1] if said else f"sanitize: {kernel} FAILED (no line: see the output above)"
        if " ok (" in line:
            runs += [(kernel, tool) for tool in tools]
        else:
            for tool in tools:
                record(args.results, row(kernel, tool, "skipped" if " skipped: " in line else "child failed",
                                         summary=line.split(" ", 2)[2]))

    def sanitized(run: tuple[str, str]) -> dict:
        kernel, tool = run
        cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1"]
        cmd += ["--racecheck-report", "all"] if tool == "racecheck" else []
        command = " ".join(cmd + ["python bench/sanitize.py --kernel", kernel])
        left = start + args.budget_s - time.time()
        if left < 10:
            return row(kernel, tool, "not run", summary=f"past --budget-s {args.budget_s}", command=command)
        run_env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if tool == "memcheck" else env
        rc, out, seconds = execute(cmd + [sys.executable, __file__, "--kernel", kernel], min(args.timeout, left),
                                   run_env)
        with open(os.path.join(args.log_dir, f"{kernel}.{tool}.log"), "w") as f:
            f.write(out)
        found = parse(out)
        status = ("timeout" if rc is None else "no summary" if found["errors"] is None else "errors" if found["errors"]
                  else "warnings" if found.get("hazards") else "child failed" if rc else "clean")
        return row(kernel, tool, status, **found, returncode=rc, seconds=round(seconds, 1), command=command)

    bad = 0
    with ThreadPoolExecutor(args.jobs) as pool, open(os.path.join(args.log_dir, "summary.log"), "a") as log:
        for r in pool.map(sanitized, runs):
            record(args.results, r)
            log.write(f"{info['commit']} {r['kernel']:<16} {r['tool']:<10} {r['status']:<12} "
                      f"{r.get('seconds', 0):>6.1f} s  {r['summary']}\n")
            bad += r["status"] != "clean"
    print(f"sanitize: {len(runs) - bad} of {len(runs)} runs clean -> {args.results}; outputs in {args.log_dir}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
