"""Per-layer RoPE (DecoderAdapter.rope_key / rotary): layers that rotate by different RoPEs, as
Gemma 3's local and global layers do, each get their own cos and sin, computed once a chunk per
RoPE. Loss and gradients equal a full-sequence forward that runs transformers' decoder layers one
by one, each given the position embeddings of its own rotary module."""
import collections
import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import oomb
from oomb import models
from oomb.models.llama import LlamaAdapter
from tiny_models import VOCAB, assert_grads_match, full_sequence_grads, llama_with_rope, rel_err

TOL = 1e-4  # relative, float32, as tests/test_engine.py
LOCAL_THETA = 100.0  # the odd layers' RoPE base; the even layers keep the model's (10000)
SEQ, CHUNK, PAGE = 150, 32, 16  # 5 chunks, the last one partial
# Packed documents per sequence of SEQ tokens: some longer than the dynamic RoPE's 64 positions.
LAYOUTS = ([1, 7, 70, 3, 69], [40, 1, 109])
ROPES = {"default": {"rope_type": "default"}, "dynamic": {"rope_type": "dynamic", "factor": 4.0}}


def rotary_with_base(config, theta: float) -> LlamaRotaryEmbedding:
    """A rotary module of plain RoPE of base `theta` for the model of `config`."""
    cfg = copy.deepcopy(config)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return LlamaRotaryEmbedding(cfg)


class AlternatingRopeAdapter(LlamaAdapter):
    """Llama whose odd layers ("local") rotate by plain RoPE of base LOCAL_THETA and whose even
    layers ("global") by the model's own rotary module."""

    def __init__(self, causal_lm):
        super().__init__(causal_lm)
        self.local_rotary = rotary_with_base(causal_lm.config, LOCAL_THETA)

    def rope_key(self, layer_idx):
        return "local" if layer_idx % 2 else "global"

    def rotary(self, h, positions, key=None):
        return (self.local_rotary if key == "local" else self.rotary_emb)(h, positions)


@pytest.fixture
def alternating(monkeypatch):
    """Llama models get AlternatingRopeAdapter (adapter_for reads ADAPTERS)."""
    monkeypatch.setitem(models.ADAPTERS, "LlamaForCausalLM", AlternatingRopeAdapter)


def make_model(rope: str):
    """4 layers (2 local, 2 global); the global RoPE `rope` made for 64 positions."""
    model = llama_with_rope(ROPES[rope], 64, layers=4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights, so a layer's missed norm changes the result
                p.add_(0.1 * torch.randn_like(p))
            if "q_proj" in name or "k_proj" in name:  # sharper attention: the rotation matters more
                p.mul_(4.0)
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 60:70] = -100  # across the chunk boundary at 64
    return ids, labels


def layers_by_hand(model, ids, labels, rotaries) -> torch.Tensor:
    """Sum of the cross entropy of `model` on (ids, labels) over the whole sequence, its decoder
    layers run one by one, layer i given rotaries[i]'s position embeddings (autograd on)."""
    body = model.model
    t = ids.shape[1]
    positions = torch.arange(t)[None]
    h = body.embed_tokens(ids)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]  # additive, as eager attention reads it
    for layer, rotary in zip(body.layers, rotaries):
        rotary(h, positions[:, :1])  # dynamic NTK forgets longer sequences it saw (a fresh model)
        h = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=rotary(h, positions))
    logits = model.lm_head(body.norm(h))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def reference(model, ids, labels, rotaries, position_ids=None):
    """(loss, {name: grad}) of full-sequence training with each layer's own RoPE; with
    position_ids, of each packed document alone, their summed losses over the batch's count."""
    model.zero_grad(set_to_none=True)
    if position_ids is None:
        spans = [(b, 0, ids.shape[1]) for b in range(ids.shape[0])]
    else:
        labels = labels.masked_fill(position_ids == 0, -100)
        spans = []
        for b, row in enumerate(position_ids):
            starts = (row == 0).nonzero().flatten().tolist() + [row.shape[0]]
            spans += [(b, s, e) for s, e in zip(starts[:-1], starts[1:])]
    count = int((labels[:, 1:] != -100).sum())
    loss = torch.zeros(())
    for b, s, e in spans:
        if e - s > 1:
            part = layers_by_hand(model, ids[b : b + 1, s:e], labels[b : b + 1, s:e], rotaries) / count
            part.backward()
            loss += part.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


def own_ropes(model):
    """Each layer's rotary module, as AlternatingRopeAdapter rotates it."""
    local = rotary_with_base(model.config, LOCAL_THETA)
    return [local if i % 2 else model.model.rotary_emb for i in range(model.config.num_hidden_layers)]


def check(model, ids, labels, position_ids=None, **engine_kwargs):
    """The engine's loss and gradients against reference() with each layer's own RoPE."""
    ref_loss, ref_grads = reference(model, ids, labels, own_ropes(model), position_ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, backend="torch", **engine_kwargs)
    assert isinstance(engine.adapter, AlternatingRopeAdapter)
    result = engine.forward_backward(ids, labels, position_ids=position_ids)
    assert rel_err(result.loss, ref_loss) <= TOL, (result.loss, ref_loss)
    assert_grads_match(model, ref_grads, TOL)
    model.zero_grad(set_to_none=True)
    return ref_loss


def packed_positions():
    return torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in LAYOUTS])


def test_reference_by_hand_is_transformers_with_one_rope():
    """The reference's layer-by-layer forward, every layer given the model's own RoPE, is the
    model's own full-sequence training; and the local RoPE changes every gradient far beyond the
    tolerance (so the engine's agreement with the reference tells the layers' RoPEs apart)."""
    model = make_model("default")
    ids, labels = batch()
    loss, grads = reference(model, ids, labels, [model.model.rotary_emb] * 4)
    ref_loss, ref_grads = full_sequence_grads(model, ids, labels)
    assert rel_err(loss, ref_loss) <= TOL
    assert grads.keys() == ref_grads.keys()
    assert all(rel_err(grads[n], ref_grads[n]) <= TOL for n in grads)
    _, local_grads = reference(model, ids, labels, own_ropes(model))
    assert all(rel_err(local_grads[n], grads[n]) > 100 * TOL for n in grads)


@pytest.mark.parametrize("rope", ["default", "dynamic"])
@pytest.mark.parametrize("packed", [False, True], ids=["sequences", "packed"])
def test_layers_rotate_by_their_own_rope(alternating, rope, packed):
    """Over 5 chunks: plain RoPE, and dynamic NTK (length-dependent: every chunk rotates as the
    whole sequence, a packed document as itself alone) on the global layers; the local layers'
    static RoPE goes through the same length-dependent path for packed documents."""
    model = make_model(rope)
    ids, labels = batch()
    check(model, ids, labels, packed_positions() if packed else None)


def test_checkpointed_layers_recompute_with_their_own_rope(alternating):
    """checkpoint_layers recomputes each layer's forward in backward: with its own cos, sin."""
    model = make_model("default")
    ids, labels = batch()
    check(model, ids, labels, checkpoint_layers=True)


def count_rope_calls(engine) -> collections.Counter:
    """Count the engine's adapter.rope() calls by key (wrapping it on the adapter)."""
    calls = collections.Counter()
    rope = engine.adapter.rope

    def counted(*args, key=None, **kwargs):
        calls[key] += 1
        return rope(*args, key=key, **kwargs)

    engine.adapter.rope = counted
    return calls


def test_rope_is_computed_once_per_chunk_and_key(monkeypatch):
    """One RoPE (every family as it is): one rope() call a chunk pass, shared by all layers; two
    RoPEs: one call a chunk pass for each, in training and evaluation."""
    n = -(-SEQ // CHUNK)  # chunks: training runs 2n - 1 chunk passes, evaluation n
    ids, labels = batch()
    model = make_model("default")
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, backend="torch")
    calls = count_rope_calls(engine)
    engine.forward_backward(ids, labels)
    assert calls == {None: 2 * n - 1}
    calls.clear()
    engine.evaluate(ids, labels)
    assert calls == {None: n}
    model.zero_grad(set_to_none=True)

    monkeypatch.setitem(models.ADAPTERS, "LlamaForCausalLM", AlternatingRopeAdapter)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, backend="torch")
    calls = count_rope_calls(engine)
    engine.forward_backward(ids, labels)
    assert calls == {"global": 2 * n - 1, "local": 2 * n - 1}
    calls.clear()
    ref_loss, _ = reference(model, ids, labels, own_ropes(model))
    assert rel_err(engine.evaluate(ids, labels).loss, ref_loss) <= TOL
    assert calls == {"global": n, "local": n}
