"""Gemma 3 (text, Gemma3ForCausalLM): sliding-window local layers between full-attention global
ones (config.layer_types), each kind with its own RoPE (rope_parameters by layer type; the model's
rotary module takes the layer type, which is each layer's rope_key), Qwen3's q/k norms, sandwich
norms (each branch's output normed before its residual add), embeddings scaled by sqrt(hidden) and
RMSNorms of (1 + weight) inside the model's own modules, and the attention scale
query_pre_attn_scalar**-0.5, which the base class reads off the attention module (scaling).

Refused: logit soft-capping (oomb's attention kernels have none,
and its loss takes the LM head's logits as they are; transformers' Gemma 3 attention ignores
attn_logit_softcapping, but a config that sets it asks for soft-capping, which would silently not
happen); bidirectional attention.
"""
from .qwen3 import Qwen3Adapter


class Gemma3Adapter(Qwen3Adapter):
    model_classes = ("Gemma3ForCausalLM",)
    rope_module = "transformers.models.gemma3.modeling_gemma3"
    supported_layer_types = ("full_attention", "sliding_attention")

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        for field, where in (("attn_logit_softcapping", "oomb's attention kernels have"),
                             ("final_logit_softcapping", "oomb's loss takes the LM head's logits with")):
            if getattr(cfg, field, None) is not None:
                raise ValueError(f"config.{field}={getattr(cfg, field)}: {where} no soft-capping; set it to None, "
                                 "as Gemma 3's published configs do")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("config.use_bidirectional_attention=True: oomb's attention is causal; set it to False")

    def rope_key(self, layer_idx):
        return self.config.layer_types[layer_idx]

    def rotary(self, h, positions, key=None):
        return self.rotary_emb(h, positions, key)

    def finish_layer(self, layer, h, o):
        b, _, c, _ = o.shape
        h = h + layer.post_attention_layernorm(layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, c, -1)))
        return h + layer.post_feedforward_layernorm(self.mlp(layer, layer.pre_feedforward_layernorm(h)))
