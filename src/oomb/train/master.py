"""fp32 master weights for bf16 training (`oomb train --master-weights float32`).

The model keeps its trainable weights in bf16: the layers, kernels and pages run on that copy.
The optimizer is built over fp32 copies of those parameters (the masters), so its state is fp32
too, and an update smaller than half a bf16 step accumulates in the master instead of being
rounded away. A step: the step's gradients move from the bf16 parameters to the masters
(take_grads: the engine's fp32 sums as they are, no rounding to bf16 between), the masters are
clipped and stepped, and each bf16 weight is set to its master rounded to nearest (copy_back).

With fp32 gradient sums (param_grad_dtype float32) each bf16 parameter's gradient is declared
fp32 (`Tensor.grad_dtype`): autograd and oomb.grad_sums.GradSums then leave the step's sum in
fp32 in .grad, where bf16 training rounds it to the weight's dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import TrainConfig


def refusal(cfg: TrainConfig, weight_dtype: torch.dtype, zero: bool) -> str:
    """Why `cfg` with master weights cannot run here ('' when it can): weights already fp32,
    sharded optimizer state (ZeRO-1), or fp32 gradient sums on a torch without grad_dtype.
    TrainConfig itself refuses tensor parallelism, LoRA and adamw8bit."""
    if cfg.master_weights == "none":
        return ""
    if weight_dtype == torch.float32:
        return ("master_weights='float32' keeps fp32 copies of bf16 weights; the weights are float32 here "
                f"(--dtype {cfg.dtype}{' on the CPU' if cfg.dtype == 'auto' else ''}): pass --dtype bfloat16, or drop "
                "--master-weights")
    if zero:
        return ("master_weights='float32' with ZeRO-1 (data parallel, --shard-optimizer): the masters and their "
                "state are not sharded; pass --no-shard-optimizer")
    if cfg.param_grad_dtype == "float32" and not hasattr(torch.Tensor, "grad_dtype"):
        return (f"master_weights='float32' with param_grad_dtype='float32' hands the fp32 gradient sums to the "
                f"masters through Tensor.grad_dtype, which torch {torch.__version__} lacks: upgrade torch, or pass "
                "--param-grad-dtype param")
    return ""


class MasterWeights:
    """The fp32 masters of a model's trainable bf16 parameters (the module's docstring): build the
    optimizer over `masters`, then take_grads() before clipping and copy_back() after each
    optimizer step."""

    def __init__(self, model: nn.Module, wide_grads: bool) -> None:
        """wide_grads: the step's gradient sums stay fp32 in .grad (param_grad_dtype float32)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.masters = [nn.Parameter(p.detach().to(torch.float32)) for p in self.params]
        if wide_grads:
            for p in self.params:
                p.grad_dtype = torch.float32

    def take_grads(self) -> list[nn.Parameter]:
        """Move each parameter's gradient to its master (an fp32 gradient as it is, a bf16 one
        widened); returns the masters, for clipping."""
        for p, m in zip(self.params, self.masters):
            g, p.grad = p.grad, None
            m.grad = None if g is None else g.to(torch.float32)
        return self.masters

    @torch.no_grad()
    def copy_back(self) -> None:
        """Each weight set to its master rounded to nearest (torch's cast: round half to even)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def state(self) -> dict[str, torch.Tensor]:
        """{parameter name: its fp32 master}, on the CPU: what a checkpoint's master-weights.safetensors holds."""
        return {n: m.detach().contiguous().cpu() for n, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], path) -> None:
        """Restore the masters from state() (ValueError naming a parameter it lacks or whose shape
        differs), and the bf16 weights from them."""
        for n, m in zip(self.names, self.masters):
            if n not in state or state[n].shape != m.shape:
                raise ValueError(f"checkpoint {path}: master-weights.safetensors has no fp32 master of shape "
                                 f"{tuple(m.shape)} for {n}; resume with the model it was written with")
            m.copy_(state[n])
        self.copy_back()
