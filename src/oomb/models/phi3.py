"""Phi-3 / Phi-4 (Phi3ForCausalLM): fused q/k/v and gate/up projections, partial rotary and
LongRoPE (both computed by the model's own rotary module and apply_rotary_pos_emb; LongRoPE picks
its factors from the sequence length, which DecoderAdapter.rope passes), dropout on each residual
branch (resid_pdrop: the model's own Dropout modules, whose masks stage 2 redraws from the chunk's
saved RNG state), config.sliding_window on every layer."""
from .base import DecoderAdapter


class Phi3Adapter(DecoderAdapter):
    model_classes = ("Phi3ForCausalLM",)
    rope_module = "transformers.models.phi3.modeling_phi3"
    supported_layer_types = ("full_attention", "sliding_attention")
    window_every_layer = True
    rope_types = ()  # transformers' Phi3Config accepts default and longrope RoPE only
    lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    tp_refusal = ("its fused qkv_proj and gate_up_proj would need a split per q/k/v and gate/up part, which "
                  "oomb.parallel does not make")

    def project_qkv(self, layer, h, cos, sin):
        """h: (B, C, hidden) -> q (B, H, C, D), k, v (B, Hkv, C, D): qkv_proj's output split as
        Phi3Attention splits it (all query heads, then the key heads, then the value heads)."""
        attn = layer.self_attn
        qkv = attn.qkv_proj(layer.input_layernorm(h))  # (B, C, (H + 2 Hkv) D)
        kv_size = self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([self.n_heads * self.head_dim, kv_size, kv_size], dim=-1)
        shape = (*h.shape[:2], -1, self.head_dim)  # (B, C, heads, D)
        q, k, v = (x.view(shape).transpose(1, 2) for x in (q, k, v))
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    @property
    def local_kv_heads(self) -> int:
        return self.n_kv_heads  # no k_proj to read it off, and never split (tp_refusal)

    def finish_layer(self, layer, h, o):
        b, _, c, _ = o.shape
        h = h + layer.resid_attn_dropout(layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, c, -1)))
        return h + layer.resid_mlp_dropout(self.mlp(layer, layer.post_attention_layernorm(h)))
