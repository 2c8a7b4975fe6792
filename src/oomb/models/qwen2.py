"""Qwen2 / Qwen2.5: Llama-style decoder with q/k/v biases (inside the Linear modules)."""
from .base import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    model_classes = ("Qwen2ForCausalLM",)
    rope_module = "transformers.models.qwen2.modeling_qwen2"
