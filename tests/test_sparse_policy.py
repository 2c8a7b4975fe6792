"""A sparse policy defined here only, plugged in through oomb.SparsePolicy (attention/policy.py):
the engine trains with it, offload stages its pages, the plan counts its bytes and evaluation
reports it, with no change anywhere else (torch backend, CPU, float32)."""
from dataclasses import dataclass

import pytest
import torch

import oomb
from oomb.eval.selection_recall import selection_recall
from oomb.memory.spec import Selection, index_dtype
from oomb.plan import plan
from test_sparse import CHUNK, PAGE, batch, masked_full_sequence, run
from tiny_models import make_model, rel_err


@dataclass(frozen=True)
class RecentPages:
    """A sliding window at page granularity: every query block of a chunk attends the `window`
    most recent earlier pages and the `sink_pages` first ones (and its own chunk, as always)."""

    window: int = 2
    sink_pages: int = 1
    block_queries: int = 32
    rep_size = 0  # scores nothing: no page representatives are stored

    @property
    def budget(self) -> int:
        return self.window + self.sink_pages

    @property
    def chunk_budget(self) -> int:
        return self.budget  # every block of a chunk reads the same pages

    def representatives(self, k, n_pages):
        raise AssertionError("rep_size is 0: the store keeps no representatives")

    def select(self, q, reps, first_page=0, block_pages=None) -> Selection:
        assert first_page == 0 and block_pages is None, "one document per sequence in this example"
        b, _, c, _ = q.shape
        n, n_kv = reps.shape[1], reps.shape[2]  # reps: (B, n, Hkv, 0, D)
        sinks = min(self.sink_pages, n)
        pages = torch.cat([torch.arange(sinks, dtype=torch.int32, device=q.device),  # ascending
                           torch.arange(max(sinks, n - self.window), n, dtype=torch.int32, device=q.device)])
        picks = torch.arange(len(pages), dtype=index_dtype(len(pages)), device=q.device)  # every block: all
        return Selection(pages.expand(b, -1).contiguous(),
                         picks.expand(b, n_kv, -(-c // self.block_queries), -1).contiguous())

    def dense_set(self, n_layers):
        return frozenset()

    def describe(self):
        return {"window": self.window, "sink_pages": self.sink_pages}


def window_mask_pages(policy, b, n_kv, t, n_layers):
    """The pages each (chunk, layer) may read by the policy's definition, as masked_full_sequence
    takes them: {(c, i): (B, Hkv, n_blocks, k)} (written from the definition, not from select())."""
    pages = {}
    for c in range(1, -(-t // CHUNK)):
        n = c * CHUNK // PAGE
        kept = [p for p in range(n) if p < policy.sink_pages or p >= n - policy.window]
        n_blocks = -(-(min(t, (c + 1) * CHUNK) - c * CHUNK) // policy.block_queries)
        for i in range(n_layers):
            pages[c, i] = torch.tensor(kept).expand(b, n_kv, n_blocks, -1)
    return pages


def test_a_policy_defined_outside_oomb_trains_exactly_for_its_mask():
    """RecentPages through the engine: its gradients equal full-sequence training with the
    equivalent block mask; offload 'all' stages its pages and equals the device pool bitwise;
    the plan counts its selections and no representatives."""
    model = make_model("qwen2", layers=2)
    ids = batch()  # (2, 200): 4 chunks of 4 pages, the last one partial
    policy = RecentPages(window=2, sink_pages=1, block_queries=32)
    assert isinstance(policy, oomb.SparsePolicy)
    engine, loss, grads = run(model, ids, policy)
    n_kv = engine.adapter.n_kv_heads
    expected = window_mask_pages(policy, 2, n_kv, ids.shape[1], 2)
    chosen = {key: sel.logical() for key, sel in engine._selection.items() if key[0] > 0}
    assert chosen.keys() == expected.keys()
    assert all(torch.equal(chosen[key].long(), expected[key]) for key in expected)
    assert engine.store.reps is None  # rep_size 0: no representative memory
    ref_loss = masked_full_sequence(model, ids, expected, policy.block_queries)
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-5
    for n, p in model.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-4, n
    model.zero_grad(set_to_none=True)
    dense = run(model, ids, None)[2]
    assert max(rel_err(grads[n], dense[n]) for n in dense) > 1e-2  # the window really drops pages
    engine_all, loss_all, grads_all = run(model, ids, policy, offload="all")
    assert engine_all.store.host.staging[0].k.shape[0] == policy.chunk_budget * 2  # its pages x batch
    assert torch.equal(loss, loss_all) and all(torch.equal(grads[n], grads_all[n]) for n in grads)
    p = plan(model.config, ids.shape[1], batch=2, chunk_size=CHUNK, page_size=PAGE, dtype=torch.float32,
             sparse=policy)
    kept = sum(t.numel() * t.element_size() for sel in engine._selection.values() for t in (sel.pages, sel.blocks))
    assert p.representatives == 0 and p.selections == kept > 0 and p.staged_pages == policy.chunk_budget


def test_selection_recall_reports_a_new_policy():
    """oomb eval's selection-recall measures any policy and reports its own settings."""
    model = make_model("qwen2", layers=2)
    policy = RecentPages(window=1, sink_pages=1, block_queries=16)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=CHUNK, page_size=PAGE, backend="torch", sparse=policy,
                                       kv_grad_dtype=None)
    ids = batch(b=1, t=256)
    result = selection_recall(engine, [(ids, ids)], 256, chunks=3, blocks=2)
    assert result["window"] == 1 and result["sink_pages"] == 1 and result["dense_layers"] == []
    assert 0 < result["recall"] < 1  # chunks 1-3 read 2 of their 4, 8, 12 earlier pages


def test_an_object_without_the_protocol_is_refused_by_name():
    """EngineConfig names what a policy lacks, or the size it gets wrong, before a model is touched."""
    half = type("Half", (), {"block_queries": 32, "budget": 2, "chunk_budget": 2, "rep_size": 0})()
    with pytest.raises(ValueError, match=r"it lacks representatives, select, dense_set, describe"):
        oomb.EngineConfig(sparse=half)
    with pytest.raises(ValueError, match=r"block_queries=0 must be an int >= 1"):
        oomb.EngineConfig(sparse=RecentPages(block_queries=0))
    with pytest.raises(ValueError, match=r"chunk_budget=2 must be >= budget=3"):
        oomb.EngineConfig(sparse=Narrow(window=2, sink_pages=1))


class Narrow(RecentPages):
    """Reads fewer pages per chunk than per query block: impossible."""

    @property
    def chunk_budget(self) -> int:
        return 2


def test_a_registered_policy_trains_through_oomb_train_by_name(tmp_path):
    """oomb.register_policy(name, build) is all a new policy needs for `--sparse-policy name`:
    oomb train builds it from the run's sparse_* settings and its engine selects pages with it;
    an unregistered name is refused by the configuration, naming the registered ones."""
    from oomb.attention.policy import POLICIES
    from oomb.train.config import TrainConfig

    selections = []

    class Counted(RecentPages):
        def select(self, *args, **kwargs):
            selections.append(self)
            return super().select(*args, **kwargs)

    oomb.register_policy("recent", lambda s: Counted(window=s.sparse_budget - s.sparse_sink_pages,
                                                     sink_pages=s.sparse_sink_pages, block_queries=32))
    try:
        cfg = TrainConfig(model="tiny", seq_len=256, chunk_size=64, page_size=16, steps=1, sparse_budget=3,
                          sparse_policy="recent", backend="torch", device="cpu", output_dir=str(tmp_path / "run"))
        assert len(oomb.train(cfg)) == 1
        assert selections and set(selections) == {Counted(window=2, sink_pages=1, block_queries=32)}
        with pytest.raises(ValueError, match=r"sparse_policy='nearby' is not a registered sparse policy; "
                                             r"registered: recent, topk"):
            TrainConfig(sparse_budget=3, sparse_policy="nearby")
    finally:
        POLICIES.pop("recent", None)
