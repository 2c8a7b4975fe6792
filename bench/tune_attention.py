"""Sweep the paged kernels' tile configurations at the benchmark shape (4,096 queries or --queries, 28/4
heads, head_dim 128, bf16, 64K earlier keys) and print them fastest first, each checked against
the current configuration's output. Feeds `_fwd_config` / `_bwd_config` in attention/paged.py.

    python bench/tune_attention.py --keys 65536 --out $OUT/tune.jsonl
    python bench/tune_attention.py --kinds fwd --sparse 64 --keys 1048576   # the sparse 1M shape
    python bench/tune_attention.py --kinds fwd --queries 16384 --keys 49152  # a dense step's chunk 16384

Each row records whether the forward's and the dQ kernel's page tiles went through tensor
descriptors (`tma`: OOMB_TMA, `dq_tma`: OOMB_DQ_TMA, both on by default on Hopper), which changes
what the best pipeline depth is.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import bench_paged  # noqa: E402
from common import record, run_info  # noqa: E402

from bench_attention import KERNELS  # noqa: E402

from oomb.attention import paged  # noqa: E402

FWD = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
       for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)) if not (m == 64 and w == 8)]
# The backward's two kernel families tune apart (one changes, the other keeps the default): dK/dV
# (pages and own chunk) and dQ.
DKDV = [dict(BLOCK_M1=m, BLOCK_N1=n, warps1=w, stages1=s)
        for (m, n), w, s in itertools.product(((32, 128), (64, 128), (64, 64), (128, 128)), (4, 8), (2, 3, 4))
        if not (m == 128 and w == 4)]
DQ = [dict(BLOCK_M2=m, BLOCK_N2=n, warps2=w, stages2=s)
      for (m, n), w, s in itertools.product(((128, 64), (128, 32), (64, 64), (128, 128)), (4, 8), (2, 3, 4))
      if not (n == 128 and w == 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=65536)
    ap.add_argument("--queries", type=int, default=4096, help="chunk length C (the dense step runs 8192-16384)")
    ap.add_argument("--kinds", default="fwd,dkdv,dq", help="which kernels' configurations to sweep")
    ap.add_argument("--sparse", type=int, default=0, metavar="BUDGET",
                    help="on bench_attention.py's engine-like top-k selection of this budget (0: dense)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "tune.jsonl"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_attention.py needs a CUDA GPU")
    info, rows = run_info(), []
    default_fwd, default_bwd = paged._fwd_config, paged._bwd_config
    run = lambda: bench_paged(args.keys, args.queries, outputs=True, sparse=args.sparse)  # noqa: E731
    reference = run()["outputs"]  # the current configuration's
    kinds = args.kinds.split(",")
    for kind, configs in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
        if kind not in kinds:
            continue
        for cfg in configs:
            if kind == "fwd":
                paged._fwd_config = lambda q, d, cfg=cfg: paged.FwdTiles(**cfg)
            else:
                paged._bwd_config = lambda q, d, cfg=cfg: dataclasses.replace(default_bwd(q, d), **cfg)
            row = {"kind": kind, "N": args.keys, "C": args.queries, "sparse_budget": args.sparse, "tma": KERNELS.tma,
                   "dq_tma": KERNELS.dq_tma, **cfg}
            try:
                r = run()
                ms = r["fwd_ms" if kind == "fwd" else "bwd_ms"]
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(r["outputs"], reference))
                row.update(ms=round(ms, 3), tflops=round((1 if kind == "fwd" else 2.5) * r["flops"] / ms / 1e9, 1),
                           max_err=err)
            except Exception as ex:  # noqa: BLE001 - a config that does not compile is a result
                row["error"] = f"{type(ex).__name__}: {str(ex)[:120]}"
            paged._fwd_config, paged._bwd_config = default_fwd, default_bwd
            row.update(info)
            record(args.out, row)
            rows.append(row)
    for kind in kinds:
        ok = sorted((r for r in rows if r["kind"] == kind and "tflops" in r), key=lambda r: -r["tflops"])
        print(f"\n{kind}: fastest first (TFLOP/s, max |diff| vs the current config's output)")
        for r in ok[:8]:
            cfg = {k: v for k, v in r.items() if k.startswith(("BLOCK", "num_", "warps", "stages"))}
            print(f"  {r['tflops']:7.1f}  {r['max_err']:.2e}  {cfg}")


if __name__ == "__main__":
    main()
