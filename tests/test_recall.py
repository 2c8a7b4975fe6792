"""Associative recall (data/recall.py, eval/kv_recall.py) against brute-force references."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import oomb
from oomb.cli import main
from oomb.data.recall import (RecallMix, RecallTask, bucket_names, bucket_of, compose, default_edges,
                              evaluation_sequences, place, queries, training_distances, wilson)
from oomb.eval.kv_recall import kv_recall
from oomb.loss import IGNORE_INDEX
from tiny_models import make_model

VOCAB = 97 + 16 + 16  # 97 text ids, 16 keys, 16 values
TASK = RecallTask(keys=16, values=16)


def brute_pairs(ids, first, keys):
    """Every (row, a, b) with ids[a] == ids[b] a key id, a < b: the needle and its query."""
    out = []
    for r in range(ids.shape[0]):
        for b in range(ids.shape[1]):
            if first <= ids[r, b] < first + keys:
                earlier = [a for a in range(b) if ids[r, a] == ids[r, b]]
                if earlier:
                    out.append((r, earlier[0], b))
    return sorted(out)


def test_compose_places_pairs_around_the_text_in_order():
    rng = np.random.default_rng(0)
    length, n = 200, 12
    text = np.arange(length) % 97
    keys, values = TASK.pair_ids(VOCAB, n, rng)
    a, b = place(length, training_distances(rng, n, length), rng, redraw=lambda: 5)
    ids, labels = compose(text, keys, values, a, b, length)
    slots = np.sort(np.concatenate([a, a + 1, b, b + 1]))
    assert len(set(slots.tolist())) == 4 * n  # no two pairs share a token
    rest = np.setdiff1d(np.arange(length), slots)
    assert np.array_equal(ids[rest], text[: length - 4 * n])  # the text, in order
    assert np.array_equal(labels[rest], ids[rest])
    assert np.array_equal(ids[a], keys) and np.array_equal(ids[b], keys)
    assert np.array_equal(ids[a + 1], values) and np.array_equal(ids[b + 1], values)
    assert (labels[np.concatenate([a, a + 1, b])] == IGNORE_INDEX).all()
    assert np.array_equal(labels[b + 1], values)
    rows, qa, qb = queries(ids[None], labels[None], TASK, VOCAB)  # read back from the tokens alone
    assert sorted(zip(rows.tolist(), qa.tolist(), qb.tolist())) == brute_pairs(ids[None], VOCAB - 32, 16)
    assert sorted(zip(qa.tolist(), qb.tolist())) == sorted(zip(a.tolist(), b.tolist()))


def test_training_distances_cover_every_scale():
    d = training_distances(np.random.default_rng(1), 20_000, 65_536)
    assert d.min() >= 2 and d.max() <= 65_534
    # below 1K: 60 % of the log-uniform half (ln 512 / ln 32767), 1.6 % of the uniform half
    assert 0.29 < (d < 1024).mean() < 0.33
    # from 16K: 13 % of the log-uniform half (ln 4 / ln 32767), 75 % of the uniform half
    assert 0.42 < (d >= 16_384).mean() < 0.47


def test_buckets_equal_brute_force():
    edges, chunk = [0, 10, 50, 200], 32
    rng = np.random.default_rng(2)
    a = rng.integers(0, 150, 500)
    b = a + rng.integers(2, 60, 500)
    got = bucket_of(a, b, chunk, edges)
    for x, y, j in zip(a, b, got):
        if x // chunk == y // chunk:
            assert j == 0
        else:
            d = y - x
            assert edges[j - 1] <= d < edges[j]
    assert bucket_names(edges) == ["same chunk", "0-10", "10-50", "50-200"]
    assert default_edges(65536) == [0, 4096, 16384, 32768, 65536]
    assert default_edges(4096) == [0, 4096]


def test_evaluation_sequences_fill_every_bucket_equally():
    edges, chunk, length = [0, 64, 256, 512], 64, 512
    seqs = evaluation_sequences(None, TASK, VOCAB, length, chunk, edges, per_bucket=10, pairs=7, seed=3)
    ids = np.stack([s[0] for s in seqs])
    labels = np.stack([s[1] for s in seqs])
    pairs = brute_pairs(ids, VOCAB - 32, 16)
    assert len(pairs) == 40
    counts = np.bincount(bucket_of(np.array([p[1] for p in pairs]), np.array([p[2] for p in pairs]), chunk, edges))
    assert counts.tolist() == [10, 10, 10, 10]
    recall = np.zeros_like(ids, dtype=bool)
    for r, a, b in pairs:
        recall[r, [a, a + 1, b, b + 1]] = True
    assert ids[~recall].max() < VOCAB - 32  # the text never uses a reserved id
    assert np.array_equal(labels[~recall], ids[~recall])
    again = evaluation_sequences(None, TASK, VOCAB, length, chunk, edges, per_bucket=10, pairs=7, seed=3)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(seqs, again))  # the same every run


def test_wilson_interval():
    lo, hi = wilson(90, 100)
    assert abs(lo - 0.8256) < 1e-3 and abs(hi - 0.9448) < 1e-3  # the textbook values
    assert wilson(0, 50)[0] == 0.0 and wilson(50, 50)[1] == 1.0


def test_reserved_ids_are_checked():
    with pytest.raises(ValueError, match="do not fit a vocabulary of 100"):
        RecallTask(keys=64, values=64).first(100)
    with pytest.raises(ValueError, match="reserves"):
        TASK.check_text(np.array([1, VOCAB - 32]), VOCAB, "x.npy")
    with pytest.raises(ValueError, match="distinct keys"):
        RecallMix(TASK, 17, VOCAB)


@pytest.mark.parametrize("budget", [0, 2])
def test_kv_recall_equals_brute_force(budget):
    """Accuracy and answer loss by bucket equal transformers' logits (dense) or a reference of the
    engine's own selections (top-k), and the needle-page hit rate equals a per-query check of the
    selections the engine kept."""
    model = make_model("qwen2_tp", layers=2, vocab=VOCAB)
    chunk, page, length, edges = 64, 16, 256, [0, 64, 128, 256]
    seqs = evaluation_sequences(None, TASK, VOCAB, length, chunk, edges, per_bucket=6, pairs=8, seed=4)
    sparse = oomb.TopKPages(budget=budget, block_queries=16) if budget else None
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=chunk, page_size=page, backend="torch", sparse=sparse,
                                       kv_grad_dtype=None)
    kept = {}
    evaluate = engine.evaluate

    def keep_selections(*args, **kw):  # the selections of each batch (kept until the next step)
        r = evaluate(*args, **kw)
        kept[len(kept)] = dict(engine._selection)
        return r

    engine.evaluate = keep_selections
    result = kv_recall(engine, seqs, TASK, edges, batch=2)
    ids = torch.from_numpy(np.stack([s[0] for s in seqs]))
    pairs = brute_pairs(ids.numpy(), VOCAB - 32, 16)
    if budget:
        logits = torch.cat([top_k_logits(model, ids[2 * n : 2 * n + 2], kept[n], chunk, page) for n in kept])
    else:
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
    hits = np.zeros(4)
    n = np.zeros(4)
    loss = np.zeros(4)
    for r, a, b in pairs:
        j = bucket_of(np.array([a]), np.array([b]), chunk, edges)[0]
        n[j] += 1
        hits[j] += int(logits[r, b].argmax()) == int(ids[r, b + 1])
        loss[j] += float(F.cross_entropy(logits[r, b][None], ids[r, b + 1][None]))
    assert [x["queries"] for x in result["buckets"]] == n.tolist() == [6, 6, 6, 6]
    assert [x["hits"] for x in result["buckets"]] == hits.tolist()
    for x, ref in zip(result["buckets"], loss / n):
        assert abs(x["answer_loss"] - ref) <= 1e-4
    if not budget:
        assert "hit_rate" not in result
        return
    for layer in result["hit_rate"]:
        i = layer["layer"]
        seen = []
        for r, a, b in pairs:
            c = b // chunk
            if a // chunk == c:
                continue
            picks = kept[r // 2][c, i].logical()[r % 2, :, (b % chunk) // 16]  # (Hkv, budget)
            own = (a + 1) // page >= c * chunk // page
            seen.append([own or (a + 1) // page in picks[h].tolist() for h in range(picks.shape[0])])
        seen = np.array(seen, dtype=float)
        assert layer["queries"] == len(seen)
        assert np.allclose(layer["heads"], seen.mean(0)) and abs(layer["rate"] - seen.mean()) < 1e-12


def top_k_logits(model, ids, selections, chunk, page):
    """Logits of a forward whose attention is masked to what top-k attends (the engine's kept
    selections: each block's picked pages, its chunk causally)."""
    from test_eval import sparse_forward_probabilities

    return sparse_forward_probabilities(model, ids, selections, chunk, page, 16, frozenset(), logits=True)


def test_train_with_recall_pairs_logs_accuracy_by_bucket(tmp_path):
    """oomb train --recall-pairs: the held-out evaluation logs recall accuracy by bucket."""
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import train

    text = np.random.default_rng(0).integers(0, 200, 40_000).astype(np.uint16)
    np.save(tmp_path / "t.npy", text)
    cfg = TrainConfig(model="tiny-kv", data=str(tmp_path / "t.npy"), seq_len=256, batch=2, steps=2, chunk_size=64,
                      page_size=16, recall_pairs=8, recall_keys=32, recall_values=32, eval_every=2,
                      output_dir=str(tmp_path / "run"), save=False, device="cpu", backend="torch")
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recall = [r["eval_recall"] for r in rows if "eval_recall" in r]
    assert len(recall) == 1 and set(recall[0]) == {"same chunk", "0-256"} and recall[0]
    with pytest.raises(ValueError, match="reserves"):  # text that uses the reserved ids
        cfg.data, cfg.output_dir = str(tmp_path / "bad.npy"), str(tmp_path / "run2")
        np.save(cfg.data, np.full(1000, 260, np.uint16))
        train(cfg)


def test_eval_kv_recall_cli(tmp_path, capsys):
    """`oomb eval --task kv-recall` on a checkpoint and a token file: a bucket table, JSON last."""
    model = make_model("qwen2", layers=2, vocab=VOCAB)
    model.save_pretrained(tmp_path / "m")
    np.save(tmp_path / "h.npy", np.random.default_rng(1).integers(0, 97, 4096).astype(np.uint16))
    main(["eval", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "h.npy"), "--task", "kv-recall",
          "--seq-len", "256", "--chunk-size", "64", "--page-size", "16", "--recall-keys", "16", "--recall-values",
          "16", "--recall-pairs", "8", "--queries", "4", "--distance-buckets", "0,64,256", "--device", "cpu",
          "--sparse-budget", "2", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert [b["bucket"] for b in result["buckets"]] == ["same chunk", "0-64", "64-256"]
    assert [b["queries"] for b in result["buckets"]] == [4, 4, 4]
    assert "same chunk" in out and "hit rate" in out and result["hit_rate"]
