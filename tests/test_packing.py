"""Packed documents (position_ids restarting at 0): loss and every gradient equal those of each
document trained alone through transformers, summed over the batch's predicted tokens."""
import pytest
import torch

import oomb
from oomb.attention.documents import documents
from tiny_models import VOCAB, assert_grads_match, llama_with_rope, make_model, rel_err

TOL = 1e-4  # relative, float32, as tests/test_engine.py

# Document lengths per sequence of 150 tokens (chunks of 32, pages of 16): one-token documents,
# documents shorter than a page, documents across several chunks, boundaries off both grids.
LAYOUTS = ([1, 7, 40, 3, 60, 1, 38], [70, 1, 1, 50, 28])
# 96 tokens (3 chunks), for the Triton kernels (interpreted: slow on the CPU).
SHORT = ([1, 7, 30, 3, 41, 14], [50, 1, 1, 30, 14])


def packed_batch(layouts=LAYOUTS, seed=1):
    """(input_ids, labels, position_ids) of sequences packed from documents of these lengths;
    labels -100 on a span inside a document and on a document's first token, as
    DataCollatorWithFlattening writes them."""
    g = torch.Generator().manual_seed(seed)
    t = sum(layouts[0])
    ids = torch.randint(0, VOCAB, (len(layouts), t), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in layouts])
    labels = ids.masked_fill(pos == 0, -100)
    labels[0, 60:65] = -100
    return ids, labels, pos


def reset_rope(model):
    """Show the rotary module one position (each of its RoPEs, for a module of one per layer type,
    as Gemma 3's): dynamic NTK then forgets the longest sequence it saw, as a freshly loaded model
    would (a document trained alone)."""
    rotary = model.model.rotary_emb
    x, position = torch.zeros(1, 1, 1), torch.zeros((1, 1), dtype=torch.long)
    if isinstance(rotary.rope_type, dict):
        for layer_type in rotary.rope_type:
            rotary(x, position, layer_type)
    else:
        rotary(x, position)


def per_document(model, ids, labels, pos):
    """transformers on each document alone: (loss, {name: grad}, count) of the sum of their
    token losses over the batch's count, their gradients summed."""
    model.zero_grad(set_to_none=True)
    spans = [(b, s, e) for b in range(ids.shape[0]) for s, e in _spans(pos[b])]
    counts = [int((labels[b, s + 1 : e] != -100).sum()) for b, s, e in spans]
    total = sum(counts)
    loss = torch.zeros((), dtype=torch.float64)
    for (b, s, e), n in zip(spans, counts):
        if n == 0:  # a one-token document predicts nothing
            continue
        reset_rope(model)
        part = model(input_ids=ids[b : b + 1, s:e], labels=labels[b : b + 1, s:e]).loss * n / total
        part.backward()
        loss += part.detach().double()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads, total


def _spans(row):
    starts = (row == 0).nonzero().flatten().tolist() + [row.shape[0]]
    return list(zip(starts[:-1], starts[1:]))


def check_packed(model, ids, labels, pos, **engine_kwargs):
    ref_loss, ref_grads, total = per_document(model, ids, labels, pos)
    engine = oomb.ChunkRecurrentEngine(model, **engine_kwargs)
    result = engine.forward_backward(ids, labels, position_ids=pos)
    assert result.num_tokens == total
    assert rel_err(result.loss, ref_loss) <= TOL, (result.loss, ref_loss)
    got = assert_grads_match(model, ref_grads, TOL)
    grads = {n: g.clone() for n, g in got.items()}
    model.zero_grad(set_to_none=True)
    return result, grads


def test_documents_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    docs = documents(pos)
    assert docs.key_start.tolist() == [[0, 0, 0, 3, 4, 4], [0] * 6]
    assert docs.doc_end.tolist() == [[3, 3, 3, 4, 6, 6], [6] * 6]
    assert docs.lengths.tolist() == [[3, 3, 3, 1, 2, 2], [6] * 6]


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_packed_equals_documents_alone(family):
    """Batch of two different layouts, 5 chunks; llama: llama3-scaled RoPE by document position."""
    model = make_model(family)
    check_packed(model, *packed_batch(), chunk_size=32, page_size=16, backend="torch")


def test_labels_at_document_starts_are_masked_by_the_engine():
    """Labels that still hold the next document's first token give the same step bitwise: the
    engine never predicts a document's first token from the document before."""
    model = make_model("qwen2")
    ids, labels, pos = packed_batch()
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    unmasked = torch.where(pos == 0, ids, labels)  # the next document's first token as a target
    results = []
    for lab in (labels, unmasked):
        r = engine.forward_backward(ids, lab, position_ids=pos)
        results.append((r.loss, r.num_tokens, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (l0, n0, g0), (l1, n1, g1) = results
    assert n0 == n1 == int((labels[:, 1:] != -100).sum())
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_one_document_equals_unpacked():
    """position_ids 0 .. T-1 (one document a sequence) give the unpacked step's loss and gradients."""
    model = make_model("qwen3")
    ids = torch.randint(0, VOCAB, (2, 100), generator=torch.Generator().manual_seed(4))
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    ref = engine.forward_backward(ids)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = engine.forward_backward(ids, position_ids=torch.arange(100).expand(2, -1))
    assert rel_err(got.loss, ref.loss) <= 1e-6 and got.num_tokens == ref.num_tokens
    for n, p in model.named_parameters():
        assert rel_err(p.grad, ref_grads[n]) <= 1e-5, n


def test_evaluate_packed():
    """evaluate(position_ids=): the documents' loss; per token, NaN where a document starts."""
    model = make_model("llama")
    ids, labels, pos = packed_batch()
    ref_loss, _, total = per_document(model, ids, labels, pos)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    result = engine.evaluate(ids, labels, position_ids=pos, per_token=True)
    assert rel_err(result.loss, ref_loss) <= TOL and result.num_tokens == total
    assert result.token_losses[pos == 0].isnan().all()
    assert not result.token_losses[(pos != 0) & (labels != -100)].isnan().any()


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 4.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
     "original_max_position_embeddings": 40},
])
def test_length_dependent_rope_by_document(rope):
    """Dynamic NTK and LongRoPE pick their frequencies from a sequence's length: each packed
    document rotates as it does alone (documents longer and shorter than the trained 40)."""
    model = llama_with_rope(rope, 40)
    check_packed(model, *packed_batch(), chunk_size=32, page_size=16, backend="torch")


def test_position_ids_errors():
    model = make_model("qwen2")
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    ids = torch.randint(0, VOCAB, (1, 10))
    with pytest.raises(ValueError, match=r"position_ids shape \(1, 9\) does not match input_ids shape \(1, 10\)"):
        engine.forward_backward(ids, position_ids=torch.arange(9)[None])
    with pytest.raises(ValueError, match=r"position_ids\[0, 0\] = 3: a sequence must start a document"):
        engine.forward_backward(ids, position_ids=torch.arange(3, 13)[None])
    with pytest.raises(ValueError, match=r"position_ids\[0, 5\] = 6 after 4: within a document positions grow by 1"):
        engine.forward_backward(ids, position_ids=torch.tensor([[0, 1, 2, 3, 4, 6, 7, 8, 9, 10]]))
    with pytest.raises(TypeError, match="position_ids must hold integer positions"):
        engine.evaluate(ids, position_ids=torch.arange(10.0)[None])


def test_packed_triton_equals_documents_alone():
    """The Triton kernels (interpreted on CPU, float32) with packed documents, in groups of 2 pages."""
    model = make_model("qwen3")
    check_packed(model, *packed_batch(SHORT), chunk_size=32, page_size=16, backend="triton", group_pages=2)


def test_packed_offload_all_never_reads_finished_documents(monkeypatch):
    """offload='all' (every page on the host), groups of 2 pages: the documents' loss and
    gradients, bitwise those of offload='none', and a chunk loads no page before its first
    document's (chunk 4's first documents start at tokens 112 and 122: pages 0-6 are never
    fetched again)."""
    from oomb.memory.offload import HostPages

    model = make_model("qwen2")
    ids, labels, pos = packed_batch()
    _, ref_grads = check_packed(model, ids, labels, pos, chunk_size=32, page_size=16, backend="torch",
                                group_pages=2)
    passes, loads = [0], []
    real = HostPages._load

    def load(self, buf, layer, span, *args, **kwargs):
        loads.append((passes[0], span))
        return real(self, buf, layer, span, *args, **kwargs)

    monkeypatch.setattr(HostPages, "_load", load)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch", group_pages=2,
                                       offload="all")
    engine.forward_backward(ids, labels, position_ids=pos, progress=lambda done, total: passes.__setitem__(0, done))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), n
    n_chunks = 5
    chunk_of_pass = list(range(n_chunks - 1)) + list(reversed(range(n_chunks)))
    first_page = engine._first_pages
    assert first_page == [0, 0, 0, 3, 7]
    assert loads and all(span[0] >= first_page[chunk_of_pass[k]] for k, span in loads)


@pytest.mark.parametrize("backend,block,layouts", [("torch", 16, LAYOUTS), ("triton", 32, SHORT)])
def test_packed_top_k_covering_every_page_equals_documents_alone(backend, block, layouts):
    """Top-k with a budget covering every page: each query block's picks are masked by document, so
    the step equals the documents trained alone."""
    model = make_model("qwen3")
    check_packed(model, *packed_batch(layouts), chunk_size=32, page_size=16, backend=backend,
                 sparse=oomb.TopKPages(budget=16, block_queries=block))


def test_packed_top_k_selects_within_documents():
    """A budget of 2 pages: every block whose documents hold at least 2 earlier pages picks among
    them only (the first is its first document's first page: the document's sink); the step still
    runs exactly over what it picked (finite loss)."""
    model = make_model("qwen2")
    ids, labels, pos = packed_batch()
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch",
                                       sparse=oomb.TopKPages(budget=2, block_queries=16))
    assert engine.forward_backward(ids, labels, position_ids=pos).loss.isfinite()
    docs = engine._docs
    checked = 0
    for (c, _), sel in engine._selection.items():
        picks = sel.logical().long()  # (B, Hkv, n_blocks, k)
        first = docs.key_start[:, c * 32 : c * 32 + 32 : 16].long() // 16  # (B, n_blocks)
        for b in range(2):
            for blk in range(picks.shape[2]):
                if c * 2 - first[b, blk] >= 2:
                    assert (picks[b, :, blk] >= first[b, blk]).all(), (c, b, blk)
                    assert (picks[b, :, blk, 0] == first[b, blk]).all(), (c, b, blk)
                    checked += 1
    assert checked > 10


@pytest.mark.parametrize("backend,layouts", [("torch", LAYOUTS), ("triton", SHORT)])
def test_packed_gpt_oss_windows_and_sinks(backend, layouts):
    """GPT-OSS: sliding-window layers (window 24) and full ones, per-head sink logits, experts:
    packed documents equal the documents alone."""
    model = make_model("gpt_oss")
    check_packed(model, *packed_batch(layouts), chunk_size=32, page_size=16, backend=backend)
