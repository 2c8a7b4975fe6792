"""Qwen3: RMSNorm on each query and key head before RoPE, explicit head_dim."""
from .base import DecoderAdapter


class Qwen3Adapter(DecoderAdapter):
    model_classes = ("Qwen3ForCausalLM",)
    rope_module = "transformers.models.qwen3.modeling_qwen3"
    per_head_modules = ("self_attn.q_norm", "self_attn.k_norm")

    def norm_q(self, attn, q):
        return attn.q_norm(q)  # (B, C, H, D): normalised over D

    def norm_k(self, attn, k):
        return attn.k_norm(k)
