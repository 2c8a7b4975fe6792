"""Llama 2/3 (incl. llama3 RoPE scaling, which the model's own rotary_emb applies)."""
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    model_classes = ("LlamaForCausalLM",)
    apply_rope = staticmethod(apply_rotary_pos_emb)
