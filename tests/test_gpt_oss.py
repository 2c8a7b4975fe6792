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
