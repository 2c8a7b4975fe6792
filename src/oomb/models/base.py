"""What oomb needs of a decoder family, and the shared Llama-style implementation.

The engine never calls a decoder layer's forward: it needs the layer split at attention
(q/k/v out, o in) so that attention can read pages. An adapter exposes exactly that, by
calling the model's own submodules (so PEFT LoRA layers, biases and norms just work) and
transformers' own RoPE functions. One adapter per family, no monkey-patching.
"""
from __future__ import annotations

import importlib
from collections.abc import Hashable
from typing import Callable, ClassVar

import torch
from torch import nn


def head_dim_of(config) -> int:
    """A transformers config's attention head size (explicit, or hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAdapter:
    """Llama-style pre-norm decoder: x + attn(norm(x)); x + mlp(norm(x)).

    Subclasses name the transformers classes they serve and the family's RoPE function.
    """

    #: transformers CausalLM class names this adapter serves
    model_classes: ClassVar[tuple[str, ...]] = ()
    #: the transformers module holding the family's apply_rotary_pos_emb ((q, k, cos, sin) -> (q, k)),
    #: imported when an adapter is made (its model exists: the family's model code is loaded)
    rope_module: ClassVar[str]
    #: config.layer_types this adapter computes
    supported_layer_types: ClassVar[tuple[str, ...]] = ("full_attention",)
    #: whether torch.compile may fuse the layer pieces (compile())
    compilable: ClassVar[bool] = True
    #: RoPE scaling types `--rope-scaling` may set (models/rope.py)
    rope_types: ClassVar[tuple[str, ...]] = ("linear", "dynamic", "yarn", "llama3")
    #: whether config.sliding_window, when set, windows every layer (Mistral-style families:
    #: transformers then masks the whole model with it, whatever config.layer_types says)
    window_every_layer: ClassVar[bool] = False
    #: module names PEFT LoRA adapts by default (`--lora-rank`): the family's linear projections
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")
    #: why tensor parallelism is refused for this family ("": oomb.parallel splits it)
    tp_refusal: ClassVar[str] = ""
    #: modules of a decoder layer applied to each head after the heads are split (q/k norms): under
    #: tensor parallelism each rank's gradient of their weights is its own heads' share, which
    #: oomb.parallel sums over the ranks
    per_head_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, causal_lm: nn.Module) -> None:
        self.causal_lm = causal_lm
        body = causal_lm.model
        self.embed_tokens = body.embed_tokens
        self.layers = body.layers
        self.norm = body.norm
        self.rotary_emb = body.rotary_emb
        self.lm_head = causal_lm.lm_head
        self.apply_rope: Callable = importlib.import_module(self.rope_module).apply_rotary_pos_emb
        cfg = causal_lm.config
        self.config = cfg
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.layers[0].self_attn.scaling
        self.vocab_size = cfg.vocab_size
        self.check_config(cfg)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def local_kv_heads(self) -> int:
        """KV heads this process computes: all of them, or its share under tensor parallelism
        (read off k_proj's local weight, so it holds however the model was split)."""
        proj = self.layers[0].self_attn.k_proj
        weight = getattr(proj, "base_layer", proj).weight
        rows = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
        return rows // self.head_dim

    @classmethod
    def layer_window(cls, config, layer_idx: int) -> int:
        """Sliding-window length of layer `layer_idx` of a transformers config, 0 for full attention
        (the engine's and the memory plan's one reading of it): config.sliding_window on every layer
        for the families that window so (their transformers code reads no layer_types), else
        config.sliding_window on the layers config.layer_types names sliding_attention."""
        if cls.window_every_layer:
            return getattr(config, "sliding_window", None) or 0
        types = getattr(config, "layer_types", None)
        return config.sliding_window if types and types[layer_idx] == "sliding_attention" else 0

    def check_config(self, cfg) -> None:
        """Reject configs whose attention oomb does not compute (raise ValueError)."""
        layer_types = getattr(cfg, "layer_types", None) or []
        other = sorted({t for t in layer_types if t not in self.supported_layer_types})
        if other:
            raise ValueError(
                f"{type(self.causal_lm).__name__} has layers of type {other}; this adapter computes "
                f"{', '.join(self.supported_layer_types)} only. Disable sliding windows in the config "
                "(e.g. use_sliding_window=False) or use a model with full attention."
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}")

    def check_trainable(self) -> None:
        """Stage 2 recomputes stage 1 exactly, but oomb's attention has no dropout."""
        p = getattr(self.config, "attention_dropout", 0.0) or 0.0
        if p and self.causal_lm.training:
            raise ValueError(
                f"config.attention_dropout={p}: oomb's paged attention has no dropout. "
                "Set model.config.attention_dropout = 0.0 (the usual value for LLM training)."
            )

    def compile(self) -> None:
        """Run the pieces around attention (norms, projections, RoPE, MLP, residuals) through
        torch.compile: their elementwise work fuses into few kernels, and under tensor parallelism
        DTensor's per-op dispatch runs once, at tracing. Layers share the compiled code (modules
        are graph inputs); each chunk length compiles once."""
        if not self.compilable:
            raise ValueError(f"{type(self.causal_lm).__name__} layers are not compiled by oomb "
                             "(data-dependent expert routing); leave compile off")
        dropout = [(n, m.p) for n, m in self.causal_lm.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if dropout:
            raise ValueError(f"compile with dropout ({dropout[0][0]}: p={dropout[0][1]}): compiled code draws its "
                             "own masks, which are not guaranteed to repeat in the recomputed chunk; set the dropout "
                             "to 0 (e.g. LoraConfig(lora_dropout=0.0)) or leave compile off")
        # Static shapes: a chunk has one length, the last chunk of a sequence maybe another (each
        # compiles once; dynamic shapes fail to trace through DTensor in torch 2.13).
        self.project_qkv = torch.compile(self.project_qkv, dynamic=False)
        self.finish_layer = torch.compile(self.finish_layer, dynamic=False)

    # -- the pieces the engine composes ----------------------------------------------------

    def rope_key(self, layer_idx: int) -> Hashable:
        """Which of the model's RoPEs layer `layer_idx` rotates by: layers of one key share one cos,
        sin per chunk, which the engine computes once (rope(..., key=...)). Every layer the same
        (None) here; a family whose layers rotate differently (e.g. local layers with one base,
        global layers with another) returns a key per kind of layer and overrides rotary()."""
        return None

    def rotary(self, h: torch.Tensor, positions: torch.Tensor, key: Hashable = None):
        """cos, sin of the RoPE `key` (rope_key()) at positions (B, C) of hidden states h: the
        model's own rotary module, one for every layer here."""
        return self.rotary_emb(h, positions)

    def rope(self, h: torch.Tensor, start: int, seq_len: int, docs=None,
             key: Hashable = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the RoPE `key` (rope_key()) for positions start .. start + C - 1 of the chunk
        h: (B, C, hidden) of a sequence of seq_len tokens.

        Length-dependent RoPE (dynamic NTK scaling, LongRoPE) picks its frequencies from the
        largest position it is given; full-sequence training gives it seq_len - 1, so every
        chunk passes that position too (and drops its row): all chunks rotate alike, as the
        whole sequence would. Static RoPE types are unaffected.

        docs: packed documents (attention/documents.Documents): each token rotates by its position
        in its document, as that document alone would, (B, C, D) cos and sin.
        """
        c = h.shape[1]
        if docs is not None:
            return self._document_rope(h, docs.positions[:, start : start + c], docs.lengths[:, start : start + c],
                                       key)
        positions = torch.arange(start, start + c + 1, device=h.device)
        # fill_, not `positions[-1] = x`: that copies x from the host, a sync per chunk
        positions[-1:].fill_(max(seq_len - 1, start + c - 1))
        cos, sin = self.rotary(h, positions[None], key)  # (1, C + 1, D)
        return cos[:, :c], sin[:, :c]

    @property
    def length_dependent_rope(self) -> bool:
        """Whether the rotary module picks its frequencies from the largest position it is given
        (transformers' dynamic_rope_update: dynamic NTK, LongRoPE). A family with several RoPEs
        (rope_key()) says whether any of them does: packed documents then rotate every key the
        length-dependent way (_document_rope), which gives a static one its usual cos, sin. A rotary
        module of several RoPEs (Gemma 3's) holds their types in a dict by layer type."""
        rope_type = getattr(self.rotary_emb, "rope_type", "default")
        types = rope_type.values() if isinstance(rope_type, dict) else (rope_type,)
        return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)

    def _document_rope(self, h: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, key: Hashable):
        """cos, sin (B, C, D) of the RoPE `key` at positions (B, C) in documents of lengths (B, C).

        Static RoPE: the positions alone. Length-dependent RoPE: each document is rotated as a
        sequence of its own length is (its last position passed, as rope() passes seq_len - 1), one
        call per length in the chunk; dynamic NTK keeps the largest length it has seen, so each
        call first shows it one position, which resets it to the trained frequencies."""
        if not self.length_dependent_rope:
            return self.rotary(h, positions, key)  # (B, C, D)
        cos = sin = None
        # One host sync per chunk, for these RoPE types only: the lengths decide the calls.
        for n in lengths.unique().tolist():
            self.rotary(h, positions.new_zeros((1, 1)), key)
            # The largest position is n - 1: the other documents' tokens (rows dropped) are clamped.
            last = positions.new_full((positions.shape[0], 1), n - 1)
            shown = torch.cat([positions.clamp(max=n - 1), last], dim=1)  # (B, C + 1)
            cos_n, sin_n = (x[:, :-1] for x in self.rotary(h, shown, key))
            mine = (lengths == n)[..., None]  # (B, C, 1)
            cos = cos_n if cos is None else torch.where(mine, cos_n, cos)
            sin = sin_n if sin is None else torch.where(mine, sin_n, sin)
        return cos, sin

    def project_qkv(self, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h: (B, C, hidden) -> q (B, H, C, D), k, v (B, Hkv, C, D); q and k after RoPE."""
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (*h.shape[:2], -1, self.head_dim)  # (B, C, heads, D)
        q = self.norm_q(attn, attn.q_proj(x).view(shape)).transpose(1, 2)
        k = self.norm_k(attn, attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    def norm_q(self, attn: nn.Module, q: torch.Tensor) -> torch.Tensor:
        return q

    def norm_k(self, attn: nn.Module, k: torch.Tensor) -> torch.Tensor:
        return k

    def window(self, layer_idx: int) -> int:
        """Sliding-window length of a layer's attention, 0 for full attention."""
        return self.layer_window(self.config, layer_idx)

    def sinks(self, layer: nn.Module) -> torch.Tensor | None:
        """Per-head attention-sink logits (H,), or None."""
        return None

    def mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.mlp(x)

    def finish_layer(self, layer: nn.Module, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention output o (B, H, C, D) and the MLP: (B, C, hidden)."""
        b, _, c, _ = o.shape
        h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, c, -1))
        return h + self.mlp(layer, layer.post_attention_layernorm(h))
