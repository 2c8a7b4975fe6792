"""Llama 2/3 (incl. llama3 RoPE scaling, which the model's own rotary_emb applies)."""
from .base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    model_classes = ("LlamaForCausalLM",)
    rope_module = "transformers.models.llama.modeling_llama"
