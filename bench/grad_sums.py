"""How far a gradient summed over chunks drifts from the exact sum, by how it is summed (CPU):
n chunk contributions of `--values` values each (unit noise plus a shared mean), summed in bf16
(what autograd does into a bf16 .grad), in fp32 then rounded once (the engine's
param_grad_dtype=torch.float32), in bf16 with stochastic rounding, and the exact sum rounded once
to bf16 (what one full-sequence backward gives). Relative L2 error against the float64 sum.

    python bench/grad_sums.py --chunks 64,256 --values 1000000
"""
from __future__ import annotations

import argparse

import torch


def stochastic_bf16(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    return ((bits + torch.randint_like(bits, 0, 1 << 16)) & -65536).view(torch.float32).bfloat16()


def errors(n: int, values: int, mean: float) -> dict[str, float]:
    contrib = torch.randn(n, values) + mean
    exact = contrib.double().sum(0)
    sums = {"bf16": torch.zeros(values, dtype=torch.bfloat16), "fp32": torch.zeros(values),
            "bf16 stochastic": torch.zeros(values, dtype=torch.bfloat16)}
    for c in contrib:
        low = c.bfloat16()  # a chunk's gradient comes out of its GEMM in the weights' dtype
        sums["bf16"] += low
        sums["fp32"] += low.float()
        sums["bf16 stochastic"] = stochastic_bf16(sums["bf16 stochastic"].float() + low.float())
    sums["fp32"] = sums["fp32"].bfloat16()
    sums["exact, rounded once"] = exact.bfloat16()
    return {k: ((v.double() - exact).norm() / exact.norm()).item() for k, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="64,256")
    ap.add_argument("--values", type=int, default=1_000_000)
    args = ap.parse_args()
    torch.manual_seed(0)
    for n in map(int, args.chunks.split(",")):
        for mean in (0.0, 1.0):
            row = errors(n, args.values, mean)
            print(f"{n:4d} chunks, mean {mean}: " + ", ".join(f"{k} {v:.2e}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
