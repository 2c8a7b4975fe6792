"""Could the dK/dV programs accumulate dQ themselves? The reduction traffic alone, timed.

The backward runs dQ as its own kernel, which computes Q K^T and dO V^T again (7 matrix products
per tile pair instead of a fused backward's 5), because adding partial dQ tiles with float
atomics gives run-to-run different bits. Integer addition is associative: partial tiles scaled
to int64 fixed point by a per-row bound (|dQ_i| <= 2 scale ||dO_i|| max|K| max||V||) sum to the
same bits in any order. Fused, each dK/dV program would add a BLOCK_M x D partial into every
query tile it visits. This kernel issues exactly those adds with nothing else (`tl.atomic_add`
of int64, the same as `red` reductions, fp32 atomics for comparison, and plain stores as the
traffic floor; each timing includes zeroing the output, as the fused kernel would), in the fused kernel's
pattern: programs of key tiles, each visiting `--visits` query tiles in a staggered order.
Defaults: top-k 64 at the 7B shape (64-query tiles x 28 heads = 1,792 query tiles, each
receiving 64 page partials; 112 visits per program). If the int64 adds alone take about as
long as the dQ kernel they would replace (`bench_attention.py --kernels`: 1.62 ms at top-k 64),
the fused backward cannot pay.

    python bench/bench_atomics.py
    python bench/bench_atomics.py --tiles 1792 --partials 512 --visits 1792   # dense 64K keys
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _add_partials(Out, n_tiles, VISITS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
                  MODE: tl.constexpr):
    """Program p adds a partial tile into VISITS query tiles, starting at its own offset (so
    programs running together hit different tiles). MODE 0: int64 atomics (`tl.atomic_add`,
    which Triton 3.6 emits as `atom`, a round trip per element), 3: the same as `red` (inline
    PTX: no result comes back; GPU only), 1: fp32 atomics, 2: plain fp32 stores (no reduction:
    the bytes alone)."""
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK_M)[:, None] * D + tl.arange(0, D)[None, :]
    x = (offs % 7 + 1).to(tl.float32) * 0.25 + p  # a partial that depends on its program
    for i in range(VISITS):
        t = (p * VISITS + i) % n_tiles
        ptrs = Out + t.to(tl.int64) * BLOCK_M * D + offs
        if MODE == 0:
            tl.atomic_add(ptrs, (x * 1024.0).to(tl.int64), sem="relaxed")
        elif MODE == 3:  # the same adds as fire-and-forget reductions (red), not atom's round trip
            tl.inline_asm_elementwise("red.global.gpu.relaxed.add.u64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                      [ptrs, (x * 1024.0).to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 1:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.store(ptrs, x)


MODES = {"int64": 0, "int64-red": 3, "fp32": 1, "store": 2}


def run(mode: str, tiles: int, partials: int, visits: int, block_m: int, d: int, device: str):
    """The output buffer after tiles * partials tile adds, and the programs that issued them."""
    programs = tiles * partials // visits
    out = torch.zeros(tiles * block_m * d, dtype=torch.int64 if mode.startswith("int64") else torch.float32,
                      device=device)
    _add_partials[(programs,)](out, tiles, VISITS=visits, BLOCK_M=block_m, D=d, MODE=MODES[mode],
                               num_warps=8 if device == "cuda" else 4)
    return out, programs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=1792, help="query tiles x heads receiving partials")
    ap.add_argument("--partials", type=int, default=64, help="partial tiles added into each query tile")
    ap.add_argument("--visits", type=int, default=112, help="query tiles each program visits")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if args.tiles * args.partials % args.visits:
        ap.error("--tiles x --partials must be a multiple of --visits")
    sums = {}
    for mode in MODES:
        sums[mode] = run(mode, args.tiles, args.partials, args.visits, args.block_m, args.head_dim, "cuda")[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            _, programs = run(mode, args.tiles, args.partials, args.visits, args.block_m, args.head_dim, "cuda")
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.reps
        adds = args.tiles * args.partials * args.block_m * args.head_dim
        item = 8 if mode.startswith("int64") else 4
        print(json.dumps({"mode": mode, "ms": round(ms, 3), "elements": adds, "programs": programs,
                          "GB/s": round(adds * item / ms / 1e6, 1), "Gadd/s": round(adds / ms / 1e6, 1)}), flush=True)
    # The integer sums are exact whatever the order: both kinds of int64 adds give the same bits.
    assert torch.equal(sums["int64"], sums["int64-red"]), "red and atom int64 sums differ"


if __name__ == "__main__":
    main()
