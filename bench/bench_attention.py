"""Paged attention kernels vs SDPA (cuDNN, flash), forward and backward TFLOP/s, one process.

4,096 queries (28 heads, 4 KV heads, head_dim 128, bf16, page size 128) against N earlier keys.
The paged kernel also does the chunk's own causal part (4,096 x 4,096 / 2), counted in its
FLOPs; SDPA runs non-causal on contiguous K/V of the earlier keys only.

    python bench/bench_attention.py --keys 16384,65536,262144,1048576
    python bench/bench_attention.py --keys 262144,1048576 --sparse 64 --kernels --no-sdpa

Prints one JSON line per (N, impl), a table of paged / best-SDPA ratios, and appends the JSON
lines (with GPU name, versions, commit, date) to --out.

--sparse BUDGET times the kernels on a top-k selection shaped like the engine's (TopKPages
defaults: blocks of 128 queries, each picking the sink page and BUDGET - 1 of the chunk's
--chunk-budget candidates; FLOPs count the selected keys). --kernels adds each kernel's GPU
time (torch.profiler, mean of 3 forward+backward runs) to the row: where the backward's time goes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

from oomb.config import KernelOptions  # noqa: E402

KERNELS = KernelOptions.from_env(os.environ)  # OOMB_TMA=0 etc.: A/B runs of the kernels' paths

H, HKV, D, M, PAGE_SIZE = 28, 4, 128, 4096, 128


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="16384,65536,262144,1048576", help="comma-separated earlier-key counts N")
    ap.add_argument("--queries", type=int, default=M, help="chunk length C (queries)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention.jsonl"))
    ap.add_argument("--no-sdpa", action="store_true", help="time only the paged kernels")
    ap.add_argument("--sparse", type=int, default=0, metavar="BUDGET",
                    help="pages each block of 128 queries attends (0: dense, every page)")
    ap.add_argument("--chunk-budget", type=int, default=256, help="with --sparse: the chunk's candidate pages")
    ap.add_argument("--kernels", action="store_true", help="each kernel's GPU time per forward+backward")
    return ap.parse_args()


BLOCK_QUERIES = 128


def engine_like_selection(n_pages: int, c: int, budget: int, chunk_budget: int, device):
    """(candidates (n_cand,) logical pages ascending, picks (1, Hkv, n_blocks, budget) ascending
    indices into them), as attention/sparse.py's Selection: the chunk's candidates (the sink page
    and chunk_budget - 1 random others, shared by the KV heads), each block of queries picking
    the sink and budget - 1 random candidates per KV head. The engine's table holds the
    candidates only, so the kernels' grids do not grow with the context; the picks of a trained
    model cluster more, which only changes how often each page is visited."""
    g = torch.Generator().manual_seed(0)
    blocks = -(-c // BLOCK_QUERIES)
    n_cand, keep = min(chunk_budget, n_pages), min(budget, n_pages, chunk_budget)
    cand = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(n_pages - 1, generator=g)[: n_cand - 1]])
    rows = [torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(n_cand - 1, generator=g)[: keep - 1]])
            .sort().values for _ in range(HKV * blocks)]
    small = torch.uint8 if n_cand <= 256 else torch.int16 if n_cand <= 2**15 else torch.int32
    return cand.sort().values.to(device), torch.stack(rows).view(1, HKV, blocks, keep).to(small).to(device)


def kernel_times(fn, runs: int = 3) -> dict:
    """GPU milliseconds per kernel name for one call of fn (mean over `runs`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_time_total > 0:
            totals[e.key[:60]] = totals.get(e.key[:60], 0.0) + e.device_time_total / 1e3 / runs
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda x: -x[1])}


def bench_paged(n_keys: int, c: int, outputs: bool = False, sparse: int = 0, chunk_budget: int = 256,
                kernels: bool = False) -> dict:
    """Times of the paged forward and backward launchers; `outputs`: also their results (o, dq,
    dk, dv of the chunk) on seeded inputs, for comparing configurations; `sparse`: on an
    engine-like selection of that budget; `kernels`: also each kernel's time."""
    from triton.testing import do_bench

    from oomb.attention.paged import _backward, _forward
    from oomb.memory.spec import LayerPages

    if outputs:
        torch.manual_seed(0)
    n_pages = n_keys // PAGE_SIZE
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, c, H, D, device=dev, dtype=dt).transpose(1, 2)  # (B, H, C, D) as the model gives it
    k = torch.randn(1, c, HKV, D, device=dev, dtype=dt).transpose(1, 2)  # (B, Hkv, C, D)
    v = torch.randn(1, c, HKV, D, device=dev, dtype=dt).transpose(1, 2)
    kp = torch.randn(n_pages, HKV, PAGE_SIZE, D, device=dev, dtype=dt)  # (n_slots, Hkv, P, D)
    vp = torch.randn_like(kp)
    dkp = torch.zeros(kp.shape, device=dev, dtype=torch.float32)  # reused across timed runs
    dvp = torch.zeros_like(dkp)
    table = torch.randperm(n_pages, device=dev).int().view(1, n_pages)  # pages scattered in the pool
    pages = LayerPages(kp, vp, dkp, dvp, table)
    keys_seen = n_keys
    if sparse:
        candidates, selection = engine_like_selection(n_pages, c, sparse, chunk_budget, dev)
        pages = pages._replace(table=table[:, candidates], selection=selection, block_queries=BLOCK_QUERIES)
        keys_seen = selection.shape[-1] * PAGE_SIZE
    do = torch.randn(1, H, c, D, device=dev, dtype=dt)
    scale = D ** -0.5

    fwd_ms = do_bench(lambda: _forward(q, k, v, pages, scale, kernels=KERNELS), return_mode="median")
    o, lse = _forward(q, k, v, pages, scale, kernels=KERNELS)
    # Backward only: the launcher that autograd's backward calls, on the saved o and lse.
    bwd_ms = do_bench(lambda: _backward(do, q, k, v, o, lse, pages, scale, kernels=KERNELS), return_mode="median")
    # FLOPs: 2 matmuls of 2*M*N*D per head over the pages, half that (causal) over the chunk.
    flops = 4 * c * keys_seen * D * H + 2 * c * c * D * H
    result = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "flops": flops}
    if kernels:
        def step():
            o, lse = _forward(q, k, v, pages, scale, kernels=KERNELS)
            _backward(do, q, k, v, o, lse, pages, scale, kernels=KERNELS)
        result["kernels_ms"] = kernel_times(step)
    if outputs:
        result["outputs"] = [o, *_backward(do, q, k, v, o, lse, pages, scale, kernels=KERNELS)]
    return result


def bench_sdpa(n_keys: int, c: int, backend) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from triton.testing import do_bench

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, H, c, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, HKV, n_keys, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, HKV, n_keys, D, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(1, H, c, D, device=dev, dtype=dt)
    with sdpa_kernel(backend):
        fwd_ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), return_mode="median")
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        bwd_ms = do_bench(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), return_mode="median")
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "flops": 4 * c * n_keys * D * H}  # non-causal


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU (the Triton kernels are timed there); none found.", file=sys.stderr)
        return 1
    from torch.nn.attention import SDPBackend

    info = run_info()
    impls = [("paged" + (f"-sparse{args.sparse}" if args.sparse else ""), None)]
    if not args.no_sdpa:
        impls += [("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
    rows = []
    for n_keys in (int(x) for x in args.keys.split(",")):
        assert n_keys % PAGE_SIZE == 0, f"--keys must be multiples of the page size {PAGE_SIZE}"
        for name, backend in impls:
            row = {"N": n_keys, "C": args.queries, "H": H, "Hkv": HKV, "D": D, "page_size": PAGE_SIZE,
                   "dtype": "bf16", "impl": name}
            try:
                r = (bench_paged(n_keys, args.queries, sparse=args.sparse, chunk_budget=args.chunk_budget,
                                 kernels=args.kernels)
                     if backend is None else bench_sdpa(n_keys, args.queries, backend))
                row.update(fwd_ms=round(r["fwd_ms"], 3), bwd_ms=round(r["bwd_ms"], 3),
                           fwd_tflops=round(r["flops"] / r["fwd_ms"] / 1e9, 1),
                           bwd_tflops=round(2.5 * r["flops"] / r["bwd_ms"] / 1e9, 1))  # bwd = 2.5x fwd FLOPs
                if backend is None:
                    row["note"] = "includes the chunk's causal self part (2*C*C*D*H FLOPs counted)"
                    if args.sparse:
                        row.update(sparse_budget=args.sparse, chunk_budget=args.chunk_budget)
                    if "kernels_ms" in r:
                        row["kernels_ms"] = r["kernels_ms"]
            except Exception as ex:  # noqa: BLE001 - a missing SDPA backend is a result, not a crash
                row["error"] = f"{type(ex).__name__}: {str(ex)[:160]}"
            row.update(info)
            record(args.out, row)
            rows.append(row)
            torch.cuda.empty_cache()

    print(f"\n{'N':>9} {'paged fwd':>10} {'best sdpa':>10} {'ratio':>6} | {'paged bwd':>10} {'best sdpa':>10} {'ratio':>6}  (TFLOP/s)")
    for n_keys in sorted({r["N"] for r in rows}):
        paged = next((r for r in rows if r["N"] == n_keys and r["impl"].startswith("paged") and "error" not in r), None)
        sdpa = [r for r in rows if r["N"] == n_keys and r["impl"].startswith("sdpa") and "error" not in r]
        if paged is None:
            continue
        bf = max((r["fwd_tflops"] for r in sdpa), default=float("nan"))
        bb = max((r["bwd_tflops"] for r in sdpa), default=float("nan"))
        print(f"{n_keys:>9} {paged['fwd_tflops']:>10.1f} {bf:>10.1f} {paged['fwd_tflops'] / bf:>6.2f} | "
              f"{paged['bwd_tflops']:>10.1f} {bb:>10.1f} {paged['bwd_tflops'] / bb:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
