"""Qwen2 / Qwen2.5: Llama-style decoder with q/k/v biases (inside the Linear modules)."""
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from .base import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    model_classes = ("Qwen2ForCausalLM",)
    apply_rope = staticmethod(apply_rotary_pos_emb)
