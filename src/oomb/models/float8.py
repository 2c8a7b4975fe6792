"""Float8 linear layers (torchao) in the decoder layers oomb runs.

A long step on an H200 is bound by the GPU's power, not by its schedule: it runs at the 700 W
cap, its clock ~15 % below full (H200, 2026-11-30, aea42d9), and the layers' GEMMs are half of its time.
Float8 GEMMs do the same products at about half the energy. torchao's `Float8Linear` replaces
each projection of the decoder layers (attention q/k/v/o, the MLP); the engine calls those
modules chunk by chunk, so nothing else changes. The LM head, embeddings, norms, attention and
LoRA adapters stay in the model's dtype, as torchtitan does.

Numerics: each GEMM input is scaled to float8 by its own amax ("tensorwise": one scale per
tensor; "rowwise": one per row, more accurate and slower). oomb's inputs are a chunk's tokens,
so the scales are per chunk: one chunk gives exactly transformers' full-sequence float8
gradients; several give float8 training with per-chunk scales, about as far from exact as
full-sequence float8 training is (tiny model, 4 chunks: 0.14 vs 0.12 relative,
tests/test_float8.py). Float8 GEMMs need an SM 8.9+ GPU (Ada, Hopper) or the CPU; run the
layers compiled (`compile_layers=True`, `--compile`) so the casts fuse.
"""
from __future__ import annotations

import torch
from torch import nn

from . import unwrap_peft

RECIPES = ("tensorwise", "rowwise")


def apply_float8(model: nn.Module, recipe: str = "tensorwise") -> int:
    """Swap the decoder layers' `nn.Linear` modules of `model` (or of the model inside a PEFT
    wrapper; its LoRA adapters are kept) for torchao's `Float8Linear`, in place. Returns how many
    were swapped; layers whose sizes are not multiples of 16 (what float8 GEMMs take) are kept."""
    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError("float8 layers need torchao: pip install torchao") from e
    causal_lm = unwrap_peft(model)
    device = next(causal_lm.parameters()).device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < (8, 9):
        raise ValueError(f"float8 GEMMs need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {'.'.join(map(str, capability))}; leave float8 off")
    layers = causal_lm.model.layers

    def swap(module: nn.Module, fqn: str) -> bool:
        return (type(module) is nn.Linear and "lora_" not in fqn
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    before = sum(type(m) is nn.Linear for m in layers.modules())
    convert_to_float8_training(layers, module_filter_fn=swap, config=Float8LinearConfig.from_recipe_name(recipe))
    swapped = before - sum(type(m) is nn.Linear for m in layers.modules())
    if swapped == 0:
        raise ValueError(f"no linear layer of {type(causal_lm).__name__}'s decoder layers has sizes that are "
                         "multiples of 16, which float8 GEMMs need; leave float8 off")
    return swapped
