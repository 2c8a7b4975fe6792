"""Liger kernels (Triton RMSNorm and SwiGLU) on the modules oomb runs.

The engine calls a model's own norm and MLP modules chunk by chunk, so Liger's in-place patch
of those modules speeds oomb's chunks up as it does transformers' forward: fewer kernels and
fewer bytes moved per token. RoPE and the loss stay oomb's (the engine rotates q and k itself
and computes the loss a slice of logits at a time). CUDA only; `pip install liger-kernel`.
"""
from __future__ import annotations

import importlib
import inspect

from torch import nn

from . import unwrap_peft

#: model_type -> Liger's patch function; GPT-OSS gets RMSNorm only (its experts are not a SwiGLU MLP)
PATCHES = {"qwen2": "apply_liger_kernel_to_qwen2", "llama": "apply_liger_kernel_to_llama",
           "qwen3": "apply_liger_kernel_to_qwen3", "gpt_oss": "apply_liger_kernel_to_gpt_oss"}


def apply_liger(model: nn.Module) -> None:
    """Replace the RMSNorm (and SwiGLU MLP) modules of `model` (or of the model inside a PEFT
    wrapper) by Liger's, in place."""
    causal_lm = unwrap_peft(model)
    model_type = getattr(causal_lm.config, "model_type", None)
    if model_type not in PATCHES:
        raise ValueError(f"Liger kernels are applied to {', '.join(PATCHES)} models; this one is {model_type!r}")
    device = next(causal_lm.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"Liger kernels run on CUDA only and this model is on {device}; use a CUDA device "
                         "or leave them off")
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise ImportError("Liger kernels need the liger-kernel package: pip install liger-kernel") from e
    patch = getattr(liger, PATCHES[model_type])
    options = {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": True,
               "swiglu": model_type != "gpt_oss"}
    accepted = inspect.signature(patch).parameters
    # Liger also swaps the classes in transformers' modeling module (for models made later):
    # put them back, so only this model changes.
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = dict(vars(modeling))
    try:
        patch(model=causal_lm, **{k: v for k, v in options.items() if k in accepted})
    finally:
        for name, value in saved.items():
            setattr(modeling, name, value)
