"""Parameter gradients summed over a step's chunks in a wider dtype (EngineConfig.param_grad_dtype).

Each chunk's backward writes a bf16 gradient for every parameter; a full-sequence backward would
have summed those contributions inside one GEMM, in fp32. `GradSums` keeps that: a hook after
every accumulation into .grad takes the chunk's gradient out of .grad and into an fp32 sum, and
the sum is rounded to the weights' dtype once, at the end. The sums are memory-bound (nothing
else in the step is), so every byte they move is step time: with n chunks, a parameter's

  first gradient       held as it is (its bf16 bytes, no copy)
  second gradient      fp32(first) + fp32(second) -> fp32 sum: one pass (8 B read+written,
                       `pair_sum`) where a copy to fp32 and an add took 16 B
  middle gradients     sum += fp32(gradient): 10 B
  last gradient        bf16(sum + fp32(gradient)) written over the gradient: one pass (8 B),
                       where an add and a rounding took 16 B

each through one Triton kernel on CUDA (`add_into`).

30 B a parameter at 4 chunks instead of 46 (a 7B at 32K tokens: about 120 GB less traffic).
The additions are the same, in the same order, rounded once: the sums are bitwise those of
adding every gradient into an fp32 buffer and rounding at the end.

The last gradient is known as such by the engine's word (`finishing()`: the step's last backward
call, in which autograd accumulates each leaf once); a parameter whose last gradient came
earlier (the final norm, a head that is not tied, through their own backward calls) is rounded
in close().
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

_BLOCK = 4096


def _triton_sum():
    """The one-pass add kernel, compiled for CUDA tensors (None where Triton is missing)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - triton ships with CUDA torch
        return None

    @triton.jit
    def pair_sum_kernel(A, B, Out, n, BLOCK: tl.constexpr):
        # Out = A + B, both read in their own dtype and added in fp32, rounded to Out's dtype
        # (round to nearest even, as torch's casts).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(A + offs, mask=mask).to(tl.float32)
        b = tl.load(B + offs, mask=mask).to(tl.float32)
        tl.store(Out + offs, (a + b).to(Out.dtype.element_ty), mask=mask)

    def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        pair_sum_kernel[(triton.cdiv(n, _BLOCK),)](a, b, out, n, BLOCK=_BLOCK, num_warps=8)

    return launch


_kernel = None


def add_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a + b, each read in its own dtype, added in fp32 (float64 where a or out is) and
    rounded once to out's dtype; out may be a or b. One pass over the three (a Triton kernel) where
    they are contiguous plain CUDA tensors of one shape and at most 32 bits: torch's add of mixed
    dtypes takes its unvectorised kernel (about 2 TB/s on the H200 where a plain copy streams at
    4). Elsewhere torch's ops, the same arithmetic."""
    global _kernel
    if (a.is_cuda and all(type(t) is torch.Tensor and t.is_contiguous() and t.shape == out.shape
                          and t.dtype != torch.float64 for t in (a, b, out))):
        if _kernel is None:
            _kernel = _triton_sum() or False
        if _kernel:
            with torch.cuda.device(a.device):
                _kernel(a, b, out)
            return out
    if a.dtype in (torch.float32, torch.float64):  # computed in a's dtype, written in out's (out may be a or b)
        return torch.add(a, b, out=out)
    return out.copy_(a.to(torch.promote_types(out.dtype, torch.float32)).add_(b))


def pair_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
             wide: torch.dtype = torch.float32) -> torch.Tensor:
    """a + b added in `wide`, rounded to `dtype` once, into a new tensor (add_into where `wide` is
    fp32)."""
    if wide != torch.float32:
        return a.to(wide).add_(b).to(dtype)
    return add_into(a, b, torch.empty(a.shape, dtype=dtype, device=a.device))


def summed_params(model: nn.Module, wide: torch.dtype | None) -> list[nn.Parameter]:
    """The trainable parameters of `model` whose chunk gradients are summed in `wide`
    (EngineConfig.param_grad_dtype): those of a narrower dtype; none when `wide` is None."""
    if wide is None:
        return []
    return [p for p in model.parameters()
            if p.requires_grad and torch.finfo(p.dtype).bits < torch.finfo(wide).bits]


class GradSums:
    """Sums each listed parameter's chunk gradients in `wide` (fp32) over one step (the module's
    docstring). A .grad the caller already had (an earlier micro-batch) starts the sum. close()
    puts every parameter's rounded sum into .grad (also after an error: what was accumulated)."""

    def __init__(self, params: list[nn.Parameter], wide: torch.dtype | None) -> None:
        self.params, self.wide = params, wide
        self.sums: dict[nn.Parameter, torch.Tensor] = {}  # in `wide`
        self.first: dict[nn.Parameter, torch.Tensor] = {}  # a first gradient, in the weights' dtype
        self.done: dict[nn.Parameter, torch.Tensor] = {}  # rounded in the step's last backward
        self.finishing_now = False
        for p in params:
            if p.grad is not None:
                self.sums[p] = p.grad.to(wide)
                p.grad = None
        self.hooks = [p.register_post_accumulate_grad_hook(self._move) for p in params]

    @contextlib.contextmanager
    def finishing(self):
        """Around the step's last backward call: each parameter it reaches gets its last gradient
        there (autograd accumulates a leaf once a call), which is added and rounded in one pass."""
        self.finishing_now = True
        try:
            yield
        finally:
            self.finishing_now = False

    def _move(self, p: nn.Parameter) -> None:
        grad, p.grad = p.grad, None
        if p in self.done:
            raise RuntimeError(f"a parameter of shape {tuple(p.shape)} received a second gradient in the step's "
                               "last backward call (GradSums.finishing): its sum was already rounded")
        total, first = self.sums.pop(p, None), self.first.pop(p, None)
        plain = type(grad) is torch.Tensor and (total is None or type(total) is torch.Tensor)
        if self.finishing_now and plain:
            if total is not None:  # bf16(sum + fp32(grad)), written over grad
                self.done[p] = add_into(total, grad, out=grad)
            elif first is not None:
                self.done[p] = pair_sum(first, grad, grad.dtype, self.wide)
            else:
                self.done[p] = grad  # its only gradient: the sum of one, exactly
        elif total is not None:
            self.sums[p] = add_into(total, grad, out=total) if plain else total.add_(grad)
        elif first is not None:
            self.sums[p] = pair_sum(first, grad, self.wide, self.wide)
        elif plain:
            self.first[p] = grad
        else:  # a DTensor: its sum starts as a copy
            self.sums[p] = grad.to(self.wide)

    def close(self) -> None:
        """Every parameter's sum into .grad, rounded to its gradient's dtype (the weight's, or the
        fp32 grad_dtype oomb.train.master declares: the sum as it is); hooks off."""
        for h in self.hooks:
            h.remove()
        for p in self.params:
            total = self.sums.pop(p, None)
            if total is not None:
                p.grad = total.to(getattr(p, "grad_dtype", None) or p.dtype)
            elif p in self.first:
                p.grad = self.first.pop(p)
            elif p in self.done:
                p.grad = self.done.pop(p)
