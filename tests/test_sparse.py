"""Page-level top-k sparse attention (torch backend, CPU, float32)."""
import pytest
import torch
import torch.nn.functional as F

import oomb
from oomb.attention.sparse import page_representatives, select_pages
from oomb.models import adapter_for
from tiny_models import VOCAB, full_sequence_grads, make_model, rel_err

CHUNK, PAGE = 64, 16


def run(model, ids, sparse, backend="torch", **kwargs):
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, backend=backend, sparse=sparse,
                                       **kwargs)
    result = engine.forward_backward(ids)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return engine, result.loss, grads


def batch(b=2, t=200, seed=3):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,representative,backend", [
    ("qwen2", "mean", "torch"), ("qwen3", "minmax", "torch"), ("qwen2", "minmax", "torch"),
    ("qwen3", "mean", "triton"),
])
def test_budget_covering_all_pages_is_dense(family, representative, backend):
    # Sparse groups run in reference.py; so does the dense run here (not the fused CPU path, whose
    # fp32 rounding differs), so that the two agree to the last few bits.
    model = make_model(family)
    ids = batch(b=1 if backend == "triton" else 2)  # the interpreter runs a program at a time
    # one group, as sparse attention reads its pages
    _, dense_loss, dense = run(model, ids, None, backend, kernels=oomb.KernelOptions(cpu_flash=False))
    # 200 tokens in chunks of 4 pages: the last chunk has 12 earlier pages; budget 12 keeps all.
    cfg = oomb.TopKPages(budget=12, representative=representative, block_queries=32)
    _, loss, grads = run(model, ids, cfg, backend)
    assert rel_err(loss, dense_loss) <= 1e-6
    for n, g in grads.items():
        assert rel_err(g, dense[n]) <= 1e-6, n
    ref_loss, ref = full_sequence_grads(model, ids, ids)  # and so transformers' training too
    assert rel_err(loss, ref_loss) <= 1e-4


def masked_full_sequence(model, ids, selection, block):
    """Full-sequence training with an explicit (T x T) mask that allows exactly what the sparse
    engine selected: the earlier pages each query block chose, plus its own chunk (causal)."""
    a = adapter_for(model)
    b, t = ids.shape
    h = a.embed_tokens(ids)
    cos, sin = a.rope(h, 0, t)
    for i, layer in enumerate(a.layers):
        q, k, v = a.project_qkv(layer, h, cos, sin)  # (B, H, T, D), (B, Hkv, T, D)
        n_kv, group = k.shape[1], q.shape[1] // k.shape[1]
        allowed = torch.zeros((b, n_kv, t, t), dtype=torch.bool)
        for start in range(0, t, CHUNK):
            end, c = min(start + CHUNK, t), start // CHUNK
            causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            allowed[:, :, start:end, start:end] = causal
            if c == 0:
                continue
            if (c, i) not in selection:  # a dense layer among top-k ones: every earlier key
                allowed[:, :, start:end, :start] = True
                continue
            sel = selection[c, i]  # (B, Hkv, n_blocks, k)
            for qi in range(start, end):
                for bi in range(b):
                    for kv in range(n_kv):
                        for page in sel[bi, kv, (qi - start) // block].tolist():
                            allowed[bi, kv, qi, page * PAGE : (page + 1) * PAGE] = True
        qg = q.reshape(b, n_kv, group, t, -1)
        s = torch.einsum("bkgtd,bksd->bkgts", qg, k) * a.scale
        s = s.masked_fill(~allowed[:, :, None], float("-inf"))
        o = torch.einsum("bkgts,bksd->bkgtd", s.softmax(-1), v).reshape(q.shape)
        h = a.finish_layer(layer, h, o)
    logits = a.lm_head(a.norm(h)).float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("representative,backend,chunk_budget", [
    ("mean", "torch", 256), ("minmax", "torch", 4), ("mean", "triton", 4),
])
def test_small_budget_gradients_exact_for_the_selected_pattern(representative, backend, chunk_budget):
    """chunk_budget=4 < the 8 or 12 earlier pages of the last chunks: its blocks choose among 4."""
    model = make_model("qwen3")
    ids = batch(t=230)
    cfg = oomb.TopKPages(budget=3, sink_pages=1, representative=representative, block_queries=32,
                         chunk_budget=chunk_budget)
    engine, loss, grads = run(model, ids, cfg, backend)
    # Every (chunk, layer) chose once; chunk 0 has no earlier page to choose.
    assert sorted(engine._selection) == [(c, i) for c in range(4) for i in range(2)]
    selection = {key: sel.logical() for key, sel in engine._selection.items()}
    for (c, _), sel in selection.items():
        assert sel.shape[-1] == (0 if c == 0 else 3)
        assert c == 0 or (sel[..., 0] == 0).all()  # the sink page is always kept
        for b in range(sel.shape[0]):  # a chunk reads at most chunk_budget distinct pages
            assert sel[b].unique().numel() <= min(4 * c, chunk_budget)
    ref_loss = masked_full_sequence(model, ids, selection, cfg.block_queries)
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-4, n
    dense = run(model, ids, None, "torch")[2]
    assert max(rel_err(grads[n], dense[n]) for n in dense) > 1e-2  # the budget really dropped pages


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dense_layers_among_top_k(backend):
    """TopKPages(dense_layers=...): those layers select nothing and attend every earlier page;
    gradients are exact for the mixed pattern; every layer dense equals dense attention read a
    selection's worth of pages at a time, bitwise; offload 'all' equals the device pool bitwise."""
    model = make_model("qwen2", layers=2)
    ids = batch()
    if backend == "torch":  # the Triton kernels under the interpreter: the mixed pattern's exactness only
        every = oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3, dense_layers=(0, -1))
        _, loss_every, grads_every = run(model, ids, every, backend)
        _, loss_dense, grads_dense = run(model, ids, None, backend, group_pages=3)
        assert torch.equal(loss_every, loss_dense)
        assert all(torch.equal(grads_every[n], grads_dense[n]) for n in grads_dense)
    cfg = oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3, dense_layers=(-1,))
    engine, loss, grads = run(model, ids, cfg, backend)
    assert sorted(engine._selection) == [(c, 0) for c in range(4)]  # only layer 0 selects
    selection = {key: sel.logical() for key, sel in engine._selection.items()}
    ref_loss = masked_full_sequence(model, ids, selection, cfg.block_queries)
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-4, n
    model.zero_grad(set_to_none=True)
    if backend == "torch":
        _, loss_all, grads_all = run(model, ids, cfg, backend, offload="all")
        assert torch.equal(loss, loss_all) and all(torch.equal(grads[n], grads_all[n]) for n in grads)
    with pytest.raises(ValueError, match="layer 2 does not exist in a model of 2 layers"):
        oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, sparse=oomb.TopKPages(dense_layers=(2,)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_offload_identical_to_device_pool(backend):
    """Offload stages only the chunk's chunk_budget pages (a gather of scattered host pages)."""
    model = make_model("qwen2", layers=3)
    n = 1 if backend == "triton" else 2  # sequences (the interpreter runs a program at a time)
    ids = batch(b=n)
    cfg = oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3)
    _, loss, grads = run(model, ids, cfg, backend, group_pages=3)
    engine, loss_all, grads_all = run(model, ids, cfg, backend, group_pages=3, offload="all")
    assert engine.store.host.staging[0].k.shape[0] == 3 * n  # chunk_budget pages x batch
    assert torch.equal(loss, loss_all)
    assert all(torch.equal(grads[n], grads_all[n]) for n in grads)
    # 'auto' with room for one layer: layer 0's pages and representatives in the device pool,
    # layers 1 and 2's (representatives included) on the host
    one_layer = engine.store.layer_page_bytes * n * 12  # batch x 12 pages (3 stored chunks of 4)
    engine, loss_auto, grads_auto = run(model, ids, cfg, backend, group_pages=3, offload="auto",
                                        gpu_page_budget_bytes=one_layer)
    assert engine.store.host.layers == [1, 2] and engine.store.reps.shape[0] == 1
    assert torch.equal(loss, loss_auto)
    assert all(torch.equal(grads[n], grads_auto[n]) for n in grads)


def test_stage2_moves_host_pages_on_the_copy_engines(monkeypatch, memmove_copier):
    """Stage 1 copies each selection of a host layer to the host as it makes it, so stage 2's
    gathers and dK/dV scatters go to the copy engines (memory/dma.py; memmove on CPU), one batched
    call a transfer; stage 1, which has just selected on the device, and the last chunk (selected
    in stage 2) keep the zero-copy kernel. Loss and gradients equal the device pool's."""
    from oomb.memory import offload

    kernel_calls = []
    copy_rows = offload.copy_rows
    monkeypatch.setattr(offload, "copy_rows", lambda *a: kernel_calls.append(a) or copy_rows(*a))
    model = make_model("qwen2", layers=3)
    cfg = oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3)
    _, loss, grads = run(model, batch(), cfg, group_pages=3)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, sparse=cfg, group_pages=3,
                                       offload="all")
    ids = batch()
    engine.reserve(*ids.shape)  # places the layers (a new host store) before the copier goes in
    engine.store.host.dma = memmove_copier
    result = engine.forward_backward(ids)
    assert torch.equal(result.loss, loss)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    # 4 chunks (200 tokens), 3 layers: in stage 2, chunks 1 and 2 read earlier pages with a
    # selection kept from stage 1, each layer in three calls: the forward's K/V, the backward's
    # K/V/dK/dV, the dK/dV written back (chunk 0 has no earlier pages; the last chunk's gathers
    # are the kernel's)
    assert memmove_copier.calls == 2 * 3 * 3
    assert all(engine._selection[c, i].host_pages[0].tolist() == engine._selection[c, i].pages.tolist()
               for c in range(4) for i in range(3))
    assert kernel_calls  # stage 1's gathers and the last chunk's


def test_stage2_loads_the_next_host_layer_ahead(monkeypatch):
    """Stage 2 knows every layer's selection: while a host layer's gathered pages are in use,
    the next layer's are already loading into the other staging buffer (forward: the layer
    above, without dK/dV; backward: the layer below, with them). The last chunk selects in
    stage 2, so its forward cannot look ahead; the first chunk has no earlier pages. The offloaded
    step's loss and gradients equal the device pool's."""
    from oomb.memory import offload

    events = []
    begin, call = offload._HostGroups._begin, offload._HostGroups.__call__
    monkeypatch.setattr(offload._HostGroups, "_begin",
                        lambda self, g: events.append(("load", self.layer, g)) or begin(self, g))

    def use(self, with_grad):
        events.append(("use", self.layer, with_grad))
        yield from call(self, with_grad)
    monkeypatch.setattr(offload._HostGroups, "__call__", use)
    model, layers = make_model("qwen2", layers=3), 3
    cfg = oomb.TopKPages(budget=2, block_queries=32, chunk_budget=3)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, sparse=cfg, group_pages=3, offload="all")
    loss = engine.forward_backward(batch(), progress=lambda done, total: events.append(("pass", done, total))).loss
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, loss_pool, grads_pool = run(model, batch(), cfg, group_pages=3)
    assert torch.equal(loss, loss_pool)
    assert all(torch.equal(grads[n], grads_pool[n]) for n in grads)
    passes = [i for i, e in enumerate(events) if e[0] == "pass"]
    n_chunks = (len(passes) + 1) // 2
    checked = 0
    for p in range(n_chunks - 1, 2 * n_chunks - 2):  # stage 2's passes, chunks n - 1 .. 1
        window = events[passes[p - 1] + 1 : passes[p]]
        for k, (kind, layer, with_grad) in enumerate(window):
            nxt = layer - 1 if with_grad else layer + 1
            if kind != "use" or not 0 <= nxt < layers or (p == n_chunks - 1 and not with_grad):
                continue
            assert ("load", nxt, with_grad) in window[:k], (p, layer, with_grad, window)
            checked += 1
    assert checked == 2 * (layers - 1) * (n_chunks - 2) + (layers - 1)


@pytest.mark.parametrize("offload,dropout,interleaved", [("all", 0.0, True), ("none", 0.0, False),
                                                        ("all", 0.1, False)])
def test_stage1_interleaves_two_chunks_with_host_layers(monkeypatch, offload, dropout, interleaved):
    """With sparse host layers stage 1 runs two chunks a layer apart (one's attention while the
    other's pages load), the older one first at every layer; sequentially otherwise, and with
    dropout (stage 2 replays each chunk's RNG)."""
    model = make_model("qwen2", layers=3)
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(dropout))
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, sparse=oomb.TopKPages(
        budget=2, block_queries=32, chunk_budget=3), group_pages=3, offload=offload)
    order, project = [], engine._project

    def logged(c, i, *args, **kwargs):
        if not torch.is_grad_enabled():  # stage 1
            order.append((c, i))
        return project(c, i, *args, **kwargs)
    monkeypatch.setattr(engine, "_project", logged)
    engine.forward_backward(batch())
    sequential = [(c, i) for c in range(3) for i in range(3)]
    assert order == ([(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0), (1, 2), (2, 1), (2, 2)]
                     if interleaved else sequential)


def test_selection_prefers_the_matching_page():
    torch.manual_seed(0)
    k = torch.randn(1, 1, 6 * PAGE, 8)  # 6 pages, 1 KV head
    reps = page_representatives(k, 6, "mean")  # (1, 6, 1, 1, 8)
    q = (10 * reps[0, 4, 0, 0]).expand(1, 2, 5, 8)  # 2 query heads share the KV head, all like page 4
    sel = select_pages(q, reps, oomb.TopKPages(budget=2, sink_pages=1, block_queries=4))
    assert sel.logical().tolist() == [[[[0, 4], [0, 4]]]]  # sink + the page the queries point at; 2 blocks


@pytest.mark.parametrize("kwargs,match", [
    ({"budget": 0}, r"budget=0\) must be a positive int"),
    ({"sink_pages": 5, "budget": 4}, r"sink_pages=5\) must be between 0 and budget=4"),
    ({"representative": "max"}, r"representative='max'\) must be one of"),
    ({"budget": 8, "chunk_budget": 4}, r"chunk_budget=4\) must be >= budget=8"),
])
def test_topk_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        oomb.TopKPages(**kwargs)


def test_block_queries_must_fit_the_kernel_tile():
    model = make_model("qwen2")
    with pytest.raises(ValueError, match=r"block_queries=16\) must be a multiple of the kernel's query tile 32"):
        run(model, batch(), oomb.TopKPages(budget=2, block_queries=16), "triton")


def test_budget_above_256_needs_no_chunk_budget():
    """chunk_budget defaults to max(256, budget): TopKPages(budget=300) is valid as written, and
    selects among 300 of 400 pages (more than uint8 indexes: int16 picks); so does the trainer's
    --sparse-budget 300 without --sparse-chunk-budget."""
    from oomb.train.config import TrainConfig
    from oomb.attention.policy import build_policy

    assert oomb.TopKPages(budget=8).chunk_budget == 256 and oomb.TopKPages(budget=300).chunk_budget == 300
    assert oomb.TopKPages(budget=300, chunk_budget=320).chunk_budget == 320
    cfg = oomb.TopKPages(budget=300, block_queries=4)
    k = torch.randn(1, 1, 400 * 2, 8, generator=torch.Generator().manual_seed(0))  # 400 pages of 2 tokens
    sel = select_pages(torch.randn(1, 2, 8, 8), page_representatives(k, 400, "mean"), cfg)
    assert sel.pages.shape == (1, 300) and sel.blocks.shape == (1, 1, 2, 300) and sel.blocks.dtype == torch.int16
    assert sel.logical()[..., 0].eq(0).all()  # the sink page, in every block
    assert build_policy(TrainConfig(sparse_budget=300)) == oomb.TopKPages(budget=300)
    assert build_policy(TrainConfig(sparse_budget=8)).chunk_budget == 256
