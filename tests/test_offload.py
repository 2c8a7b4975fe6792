"""Offload modes on a CPU model: the host tier is plain memory, the code path is the GPU's.

Pages staged a group at a time through two buffers must give gradients identical (bitwise)
to pages in the device pool: the same kernels run on the same data in the same order.
"""
import dataclasses

import pytest
import torch

import oomb
from tiny_models import make_model


def step(offload, progress=None, **kwargs):
    model = make_model("qwen2", layers=3)
    ids = torch.randint(0, 97, (2, 203), generator=torch.Generator().manual_seed(0))
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch", offload=offload,
                                       group_pages=3, **kwargs)
    result = engine.forward_backward(ids, progress=progress)
    return engine, result.loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return step("none")


@pytest.mark.parametrize("offload,kwargs,host_layers", [
    ("all", {}, [0, 1, 2]),
    ("auto", {"gpu_page_budget_bytes": 0}, [0, 1, 2]),
    # exactly one layer's pages: 2 sequences x 12 stored pages x (K, V, dK, dV: 4 x 4 B) x
    # 1 KV head x 16 tokens x 16 dims
    ("auto", {"gpu_page_budget_bytes": 2 * 12 * 16 * 256}, [1, 2]),
    ("auto", {}, []),  # a CPU model: everything fits "the device"
])
def test_offload_gradients_identical_to_none(reference, offload, kwargs, host_layers):
    _, ref_loss, ref_grads = reference
    engine, loss, grads = step(offload, **kwargs)
    assert engine.store.host.layers == host_layers
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def test_host_arena_is_reused_across_steps():
    model = make_model("qwen2", layers=2)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all", group_pages=2)
    engine.forward_backward(torch.randint(0, 97, (1, 200)))
    arena = engine.store.host.arena[0].k
    engine.forward_backward(torch.randint(0, 97, (1, 150)))  # shorter: same arena
    assert engine.store.host.arena[0].k is arena


def test_reserve_allocates_up_front():
    model = make_model("qwen2", layers=2)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="auto",
                                       gpu_page_budget_bytes=2 * 12 * 16 * 256)  # one layer's pages
    engine.reserve(2, 200)  # 7 chunks: 6 stored x 2 pages a sequence and layer
    slots, arena = engine.store.pool.n_slots, engine.store.host.arena[1].k
    assert slots == 1 * 2 * 12 and arena.shape[:2] == (12, 2)
    engine.forward_backward(torch.randint(0, 97, (2, 200)))
    assert engine.store.pool.n_slots == slots and engine.store.host.arena[1].k is arena


def test_shorter_step_keeps_the_pinned_arena():
    """'auto': a short step puts every layer on the device; the arena reserved for the long
    steps stays (no re-pinning), and the long step after it computes the same loss."""
    model = make_model("qwen2", layers=2)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="auto",
                                       gpu_page_budget_bytes=2 * 12 * 16 * 256)  # one layer's pages at 200 tokens
    engine.reserve(2, 200)
    host, arena = engine.store.host, engine.store.host.arena[1].k
    ids = torch.randint(0, 97, (2, 200), generator=torch.Generator().manual_seed(0))
    first = engine.forward_backward(ids).loss
    engine.forward_backward(ids[:, :40])  # 2 stored pages a layer: both layers fit the budget
    assert engine.store._row == {0: 0, 1: 1} and engine.store.host is host
    model.zero_grad(set_to_none=True)
    assert torch.equal(engine.forward_backward(ids).loss, first)
    assert engine.store.host.arena[1].k is arena and engine.store.host.layers == [1]


def test_host_memory_is_checked_before_the_step(monkeypatch):
    import oomb.memory.step
    monkeypatch.setattr(oomb.memory.step, "available_host_bytes", lambda: 4 * 2**20)
    model = make_model("qwen2", layers=2)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all", group_pages=128)
    # 2 layers x 4 KiB a page (K, V, dK, dV fp32: 1 KV head x 16 tokens x 16 dims) / 16 tokens
    # = 512 B per token: 4 MiB fit about 8,192 tokens; 16K tokens need 8 MiB of pages + 1 MiB of staging.
    with pytest.raises(ValueError, match=r"needs 9.0 MiB more host memory for its pages \(512 B per token of "
                                         r"context\), but only 4.0 MiB is available: about 8,192 tokens would fit"):
        engine.forward_backward(torch.randint(0, 97, (1, 16384)))
    engine.forward_backward(torch.randint(0, 97, (1, 1024)))  # 0.25 MiB of pages + staging: fine
    # A staging buffer holds a group, or a layer's pages when fewer: 62 of 1,024 tokens (the last
    # chunk is not stored), not the default group's 1,024
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="all")
    engine.forward_backward(torch.randint(0, 97, (1, 1024)))
    assert [x.shape[0] for x in engine.store.host.staging[0]] == [62] * 4


def test_auto_budget_counts_what_is_still_to_come(monkeypatch):
    """'auto' room = free device memory - gradients not yet allocated - reserved_gpu_bytes -
    working set - margin, measured once: a later step sees the same room although the gradients
    and optimizer state then take part of the free memory; the pages get it less the staging."""
    from oomb.placement import place
    from oomb.plan import GPU_MARGIN_BYTES
    model = make_model("qwen2", layers=2)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, offload="auto", reserved_gpu_bytes=1000)
    free = 10 * 2**30
    monkeypatch.setattr(engine.memory, "free_gpu_bytes", lambda: free)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    fixed = engine.memory.headroom(engine.config) + grads + 1000  # what the room is without those two
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # now allocated: no longer subtracted
    assert engine.memory.headroom(engine.config) == fixed - 1000
    assert 0 < free - fixed <= GPU_MARGIN_BYTES + 2**30  # margin and working set only
    rooms = iter([123, 456])
    monkeypatch.setattr(engine.memory, "headroom", lambda cfg: next(rooms))
    monkeypatch.setattr(engine.memory, "device", torch.device("cuda"))  # the room is a CUDA matter
    first, later = engine.placement_input(1, 64), engine.placement_input(1, 64)
    assert first.gpu_room == later.gpu_room == 123  # the first step's, kept
    layer = 64 * engine.store.layer_page_bytes
    x = dataclasses.replace(first, gpu_room=first.staging_bytes + layer + 1)
    assert place(x).device_layers == 1 and place(dataclasses.replace(x, gpu_room=x.gpu_room - 2)).device_layers == 0


@pytest.mark.parametrize("keep_attention", [False, True])
def test_next_host_layer_loads_while_this_one_computes(monkeypatch, reference, keep_attention):
    """Dense host layers: the next layer's first group (forward: the layer above, without dK/dV;
    backward: the layer below, with them) starts loading once this layer's last group is in
    use, into the staging buffer its earlier groups are done with, so it hides behind this
    layer's last group. Stage 2's forward of a layer whose output stage 1 kept reads no page
    and loads none. Loss and gradients stay bitwise those of the device pool."""
    from oomb.memory import offload

    events = []
    load, call = offload.HostPages._load, offload._HostGroups.__call__
    monkeypatch.setattr(offload.HostPages, "_load", lambda self, buf, layer, span, with_grad, *args:
                        events.append(("load", layer, with_grad, span[0], buf))
                        or load(self, buf, layer, span, with_grad, *args))

    def use(self, with_grad):
        for g, pages in enumerate(call(self, with_grad)):
            events.append(("group", self.layer, with_grad, g, len(self.spans)))
            yield pages
    monkeypatch.setattr(offload._HostGroups, "__call__", use)
    engine, loss, grads = step("all", progress=lambda done, total: events.append(("pass", done, total)),
                               keep_attention=keep_attention)
    _, ref_loss, ref_grads = reference
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    if keep_attention:
        assert tuple(engine.kept.layers) == (0, 1)  # the last layer's attention does not run in stage 1

    passes = [k for k, e in enumerate(events) if e[0] == "pass"]
    n_chunks = (len(passes) + 1) // 2
    checked = 0
    for p in range(1, len(passes)):
        window = events[passes[p - 1] + 1 : passes[p]]
        stage1 = p < n_chunks - 1
        kept = keep_attention and p >= n_chunks  # stage 2 of a chunk stage 1 ran (not the last one)
        for k, (kind, layer, with_grad, g, n) in enumerate(window):
            nxt = layer - 1 if with_grad else layer + 1
            last_attending = 1 if stage1 else 2  # stage 1 skips the last layer's attention
            if kind != "group" or g != n - 1 or n < 2 or not 0 <= nxt <= last_attending:
                continue
            if not with_grad and kept:
                continue
            follower = window[k - 1]
            assert follower[:4] == ("load", nxt, with_grad, 0), (p, window[k - 3 : k + 1])
            own = next(e for e in reversed(window[: k - 1]) if e[:3] == ("load", layer, with_grad))
            assert own[4] != follower[4]  # the buffer the last group is not in
            checked += 1
        if kept:  # the kept layers' forwards read no page: no load without dK/dV
            assert not [e for e in window if e[0] == "load" and not e[2] and e[1] in engine.kept.layers]
    assert checked >= (2 if keep_attention else 4) * (n_chunks - 3)
