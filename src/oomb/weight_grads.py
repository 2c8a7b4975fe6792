"""Weight gradients summed over chunks inside their GEMM (`fused_weight_grads`).

Without it, each chunk's backward computes a Linear's weight gradient dW = dY^T X into a new
tensor that autograd then adds into .grad (or a hook into an fp32 sum): the GEMM writes the
(out, in) gradient and the add reads it and the running sum and writes the sum again. Here the
GEMM adds into the running sum itself (C = dY^T X + C, cuBLAS's beta = 1): the sum is read and
written once per chunk, no chunk gradient is materialised, and the sum rounds once per chunk
(twice before: the chunk gradient, then the sum).

The sums are persistent buffers, one per weight, in the weight's dtype (then the sum is .grad
itself) or in fp32 (param_grad_dtype; rounded into .grad when the step ends). Only plain
nn.Linear weights that are trainable, plain tensors (not DTensor shards) and used by nothing
else (not tied to the embedding) take part; the others keep autograd's accumulation.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in one GEMM. A 16-bit product into an fp32 sum: fp32 output from 16-bit
    inputs on CUDA (cuBLAS accumulates in fp32 either way); on a CPU the inputs are upcast."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


class _LinearSum(torch.autograd.Function):
    """F.linear whose backward adds dY^T X into `acc` (and gives no gradient to the weight)."""

    @staticmethod
    def forward(ctx, x, weight, bias, acc):
        ctx.save_for_backward(x, weight)
        ctx.acc = acc
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        add_product(ctx.acc, dy2.t(), x.reshape(-1, x.shape[-1]))
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dbias = dy2.sum(0) if ctx.needs_input_grad[2] else None
        return dx, None, dbias, None


def _forward(module: nn.Linear, sums: WeightGradSums, x: torch.Tensor) -> torch.Tensor:
    return _LinearSum.apply(x, module.weight, module.bias, sums.acc[module.weight])


class WeightGradSums:
    """The fused weight-gradient sums of an engine's step.

    begin() (before the step) makes or resets each weight's sum from its .grad and routes the
    modules' forward through _LinearSum; close() (after it, also after an error) restores their
    forward and leaves the sums in .grad. The forward functions are made once, so compiled code
    that inlines the modules sees the same function at every step (no recompilation).
    """

    def __init__(self, modules: list[nn.Linear], wide: torch.dtype | None) -> None:
        self.modules = modules
        self.wide = wide
        self.acc: dict[nn.Parameter, torch.Tensor] = {}
        self._forwards = {m: partial(_forward, m, self) for m in modules}

    @classmethod
    def of(cls, model_layers: nn.Module, others: list[nn.Module], excluded: list[nn.Parameter],
           wide: torch.dtype | None) -> WeightGradSums:
        """The eligible nn.Linear modules of the layers and `others` (each weight used once, none
        in `excluded`, e.g. the embedding a head may be tied to)."""
        modules = [m for part in [model_layers, *others] for m in part.modules() if type(m) is nn.Linear]
        uses: dict[int, int] = {}
        for m in modules:
            uses[id(m.weight)] = uses.get(id(m.weight), 0) + 1
        skip = {id(p) for p in excluded}
        return cls([m for m in modules if m.weight.requires_grad and type(m.weight.data) is torch.Tensor
                    and uses[id(m.weight)] == 1 and id(m.weight) not in skip], wide)

    def params(self) -> list[nn.Parameter]:
        return [m.weight for m in self.modules]

    def _dtype(self, p: torch.Tensor) -> torch.dtype:
        return self.wide if self.wide is not None and torch.finfo(self.wide).bits > torch.finfo(p.dtype).bits else p.dtype

    def allocate(self) -> None:
        """The sums, made once (so that memory accounting before a step sees them)."""
        for p in self.params():
            if p not in self.acc:
                self.acc[p] = torch.zeros(p.shape, dtype=self._dtype(p), device=p.device)

    def begin(self) -> None:
        self.allocate()
        for p in self.params():
            acc = self.acc[p]
            if p.grad is None:
                acc.zero_()
            elif p.grad is not acc:  # an earlier micro-batch's gradient starts the sum
                acc.copy_(p.grad)
            p.grad = acc if acc.dtype == p.dtype else None
        for m in self.modules:
            m.forward = self._forwards[m]

    def close(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        for p in self.params():
            acc = self.acc[p]
            p.grad = acc if acc.dtype == p.dtype else acc.to(p.dtype)
