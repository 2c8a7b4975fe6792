"""Mixtral: Mistral's attention (sliding_window on every layer when set) and a top-k mixture of
SwiGLU experts run by the model's own sparse MoE block (its router jitter, when set, drawn from
the chunk's RNG state, so stage 2 redraws the same noise)."""
from .experts import RoutedExperts
from .mistral import MistralAdapter


class MixtralAdapter(RoutedExperts, MistralAdapter):
    model_classes = ("MixtralForCausalLM",)
    rope_module = "transformers.models.mixtral.modeling_mixtral"
