"""GPT-OSS: sliding-window and full layers, attention sinks, MoE; against transformers."""
import pytest
import torch

import oomb
from tiny_models import VOCAB, full_sequence_grads, make_model, rel_err

TOL = 1e-4


@pytest.mark.parametrize("seq_len,chunk_size,page_size,kwargs", [
    (150, 32, 16, {}),                      # window 24 < chunk: 1-2 earlier pages reachable
    (150, 32, 16, {"backend": "triton"}),   # the kernels' window masks (interpreted)
    (97, 16, 16, {"backend": "triton", "group_pages": 1}),
    (97, 16, 16, {"group_pages": 1}),       # window 24 > chunk: reaches into 2 earlier chunks
    (150, 32, 16, {"offload": "all", "group_pages": 2}),
    (150, 32, 16, {"sparse": oomb.TopKPages(budget=8, block_queries=8)}),  # full layers: budget >= pages
])
def test_gpt_oss_equals_full_sequence(seq_len, chunk_size, page_size, kwargs):
    model = make_model("gpt_oss")
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[1, 20:40] = -100
    ref_loss, ref = full_sequence_grads(model, ids, labels)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=chunk_size, page_size=page_size,
                                       **{"backend": "torch", **kwargs})
    result = engine.forward_backward(ids, labels)
    assert rel_err(result.loss, ref_loss) <= TOL
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= TOL, n
    sinks = [p.grad for n, p in model.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == 2 and all(g.abs().sum() > 0 for g in sinks)  # sinks get their gradient


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_layers_store_only_reachable_pages(backend):
    """Window 8 < page 16: a later chunk's window reaches only the last page of a chunk, so the
    sliding layer stores 1 page a chunk, the full layer all 2; gradients stay exact."""
    model = make_model("gpt_oss")
    model.config.sliding_window = 8
    for layer in model.model.layers:
        if layer.self_attn.sliding_window:
            layer.self_attn.sliding_window = 8
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(6))
    ref_loss, ref = full_sequence_grads(model, ids, ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend=backend, offload="all")
    result = engine.forward_backward(ids)
    assert engine.store.host.layers == [1]  # the full layer goes to the host, the sliding one never
    assert engine.store.pool.n_slots == 2 * 4 * 1  # batch 2 x 4 stored chunks x 1 tail page
    assert rel_err(result.loss, ref_loss) <= TOL
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref[n]) <= TOL, n


def test_gpt_oss_lora_on_attention_and_sparse_offload():
    """The benchmark's set-up in miniature: LoRA adapters on attention (base frozen), full
    layers top-k sparse on the host; only adapter gradients, equal to full-sequence training
    when the budget covers every page."""
    import peft
    model = peft.get_peft_model(make_model("gpt_oss"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False))
    ids = torch.randint(0, VOCAB, (1, 150), generator=torch.Generator().manual_seed(7))
    ref_loss, ref = full_sequence_grads(model, ids, ids)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all",
                                       sparse=oomb.TopKPages(budget=8, block_queries=8, chunk_budget=8))
    result = engine.forward_backward(ids)
    assert rel_err(result.loss, ref_loss) <= TOL
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for n, p in trained:
        assert rel_err(p.grad, ref[n]) <= TOL, n


def test_gpt_oss_20b_preset():
    from oomb.presets import load_model
    model = load_model("gpt-oss-20b", dtype=torch.bfloat16, device="meta")
    assert 20.8e9 < sum(p.numel() for p in model.parameters()) < 21.0e9  # 20.9B, as published
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    small = load_model("gpt-oss-20b", dtype=torch.bfloat16, device="meta", num_hidden_layers=4)
    assert small.config.layer_types == ["sliding_attention", "full_attention"] * 2
