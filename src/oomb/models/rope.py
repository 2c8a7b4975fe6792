"""Context extension: a new RoPE base (`--rope-theta`) or scaling (`--rope-scaling TYPE:FACTOR`),
written into the model config's `rope_parameters` as transformers reads them, before the model is
built, so the model's own rotary embedding computes them and `save_pretrained` keeps them.

    linear:F     positions divided by F (position interpolation)
    dynamic:F    NTK-aware base that grows with the sequence length past max_position_embeddings
    yarn:F       YaRN; original_max_position_embeddings is the model's max_position_embeddings
                 (or TYPE:FACTOR:ORIGINAL), which becomes ORIGINAL * F; a model already
                 yarn-scaled (GPT-OSS) gets F times its factor
    llama3:F     Llama 3.1's frequency-dependent scaling (low_freq_factor 1, high_freq_factor 4)
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

SCALING_TYPES = ("linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    type: str
    factor: float
    original: int | None = None  # yarn / llama3: the length the model was trained at

    @classmethod
    def parse(cls, text: str) -> RopeScaling:
        """'yarn:4' or 'yarn:4:32768' -> RopeScaling('yarn', 4.0, 32768)."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in SCALING_TYPES:
            raise ValueError(f"--rope-scaling {text!r} must be TYPE:FACTOR or TYPE:FACTOR:ORIGINAL_LENGTH with "
                             f"TYPE one of {', '.join(SCALING_TYPES)}, e.g. yarn:4")
        try:
            factor = float(parts[1])
            original = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(f"--rope-scaling {text!r}: FACTOR must be a number and ORIGINAL_LENGTH an integer, "
                             "e.g. yarn:4:32768") from None
        if not math.isfinite(factor) or factor <= 1.0:
            raise ValueError(f"--rope-scaling {text!r}: FACTOR={factor:g} must be > 1 and finite (it extends the "
                             "context by that much), e.g. yarn:4")
        if original is not None and original < 1:
            raise ValueError(f"--rope-scaling {text!r}: ORIGINAL_LENGTH must be a positive number of tokens")
        return cls(parts[0], factor, original)


def apply_rope(config, theta: float | None = None, scaling: str | None = None, family: str = "") -> None:
    """Set `config.rope_parameters` (and max_position_embeddings for yarn / llama3) in place.

    family: the adapter class whose `rope_types` are allowed (checked before anything is built)."""
    if theta is None and not scaling:
        return
    from . import adapter_class

    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params or per_layer_rope(params):
        raise ValueError(f"{type(config).__name__} has no single rope_parameters dict (per-layer RoPE); "
                         "--rope-theta / --rope-scaling are not supported for it")
    if theta is not None:
        if not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"--rope-theta {theta:g} must be > 0 and finite: the new RoPE base, e.g. 8x the "
                             f"model's {params.get('rope_theta', 10_000):g}")
        params["rope_theta"] = float(theta)
    if scaling:
        s = RopeScaling.parse(scaling)
        adapter = adapter_class(config, family)
        allowed = adapter.rope_types
        if s.type not in allowed:
            raise ValueError(f"--rope-scaling {scaling!r}: {adapter.model_classes[0]} supports "
                             f"{', '.join(allowed) or 'no RoPE scaling'} (its positions are already "
                             f"{params.get('rope_type', 'default')}-scaled: replacing that discards what it was "
                             "trained with); use --rope-theta or one of those types")
        if params.get("rope_type") == s.type and s.type in ("yarn", "llama3") and s.original is None:
            # Already scaled by this type: extend it further (factor F times the trained one, same
            # original length), as a model trained with yarn:32 extended by 2 is yarn:64.
            factor, original = params["factor"] * s.factor, params["original_max_position_embeddings"]
            params["factor"] = factor
            config.max_position_embeddings = int(original * factor)
            config.rope_parameters = params
            return
        for key in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                    "attention_factor", "beta_fast", "beta_slow", "short_factor", "long_factor", "truncate"):
            params.pop(key, None)  # the keys of the type this one replaces
        params.update(rope_type=s.type, factor=s.factor)
        if s.type in ("yarn", "llama3"):
            original = s.original or config.max_position_embeddings
            params["original_max_position_embeddings"] = original
            config.max_position_embeddings = int(original * s.factor)
        if s.type == "llama3":
            params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    config.rope_parameters = params


def check_positions(config, seq_len: int, theta: float | None, scaling: str | None) -> None:
    """Warn when seq_len is past the positions the model was trained for and nothing extends RoPE."""
    limit = getattr(config, "max_position_embeddings", None)
    params = getattr(config, "rope_parameters", None) or {}
    per_layer = per_layer_rope(params)
    if limit and seq_len > limit and (per_layer or params.get("rope_type", "default") == "default") \
            and theta is None and not scaling:
        fix = ("Its RoPE is set per layer type: --rope-theta / --rope-scaling do not extend it" if per_layer
               else f"Extend it with --rope-theta (e.g. 8x the base) or --rope-scaling yarn:{-(-seq_len // limit)}")
        warnings.warn(f"seq_len={seq_len:,} exceeds the model's max_position_embeddings={limit:,} and RoPE is not "
                      f"extended: positions past {limit:,} were never seen in training. {fix}", stacklevel=2)


def per_layer_rope(rope_parameters: dict) -> bool:
    """Whether a config's rope_parameters are given per layer type (Gemma 3's: a dict each), which
    --rope-theta / --rope-scaling do not extend."""
    return any(isinstance(v, dict) for v in rope_parameters.values())
