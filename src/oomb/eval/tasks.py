"""Long-context evaluation tasks, each through the engine's evaluation path (one stage-1 pass per
sequence: pages, offload and top-k sparse attention as in training, so they run at 1M tokens).

    loss              mean cross entropy per predicted token
    position-loss     mean cross entropy by the target's position in the sequence: a model that
                      uses its context keeps lowering it further along
    retrieval         key-value needles at given depths of held-out text, queried at the end: a
                      hit when every value token is the argmax prediction (teacher-forced)
    kv-recall         single-token key-value pairs (train/recall.py) at equal numbers in each
                      needle-to-query distance bucket: accuracy with its 95 % interval and the
                      answer's loss by bucket; top-k reads also the needle-page hit rate (is the
                      needle's page among those the query's block attends), per layer and KV head
    selection-recall  top-k models: the share of the exact softmax attention mass that falls on
                      what top-k attends (its selected pages and the chunk itself), per layer

Each returns a JSON-ready dict with "task" naming it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from ..engine import ChunkRecurrentEngine
from ..loss import IGNORE_INDEX
from ..train.needles import DEFAULT_TEMPLATE, hits, make_needle, with_needles
from ..train.recall import RecallTask, Tally, answers, bucket_of, queries

Batches = Iterable[tuple[torch.Tensor, ...]]  # (input_ids, labels) or packed (input_ids, labels, position_ids)


def mean_loss(engine: ChunkRecurrentEngine, batches: Batches, progress=None) -> dict:
    total, tokens = 0.0, 0
    for ids, labels, *positions in batches:
        r = engine.evaluate(ids, labels, progress=progress, position_ids=positions[0] if positions else None)
        total += float(r.loss) * r.num_tokens
        tokens += r.num_tokens
    if not tokens:
        raise ValueError("no tokens to evaluate")
    return {"task": "loss", "tokens": tokens, "loss": total / tokens}


def default_buckets(seq_len: int) -> list[int]:
    """Bucket starts 0, 1, 2, 4, ... (powers of two below seq_len); the last bucket ends at seq_len."""
    return [0] + [2**k for k in range(int(math.log2(max(1, seq_len - 1))) + 1) if 2**k < seq_len]


def check_buckets(starts: list[int], seq_len: int) -> list[int]:
    if not starts or starts != sorted(set(starts)) or starts[0] < 0 or starts[-1] >= seq_len:
        raise ValueError(f"--buckets {','.join(map(str, starts))}: bucket starts must be increasing, >= 0 and < "
                         f"seq_len={seq_len:,} (the last bucket ends at seq_len)")
    return starts


def position_loss(engine: ChunkRecurrentEngine, batches: Batches, seq_len: int, starts: list[int] | None = None,
                  progress=None) -> dict:
    """Mean cross entropy of the targets at positions [start, end) of each bucket (position p: the
    token at p predicted from tokens < p; p = 0 is never a target); empty buckets are left out.
    Packed batches bucket each target by its position in its own document."""
    starts = check_buckets(starts if starts is not None else default_buckets(seq_len), seq_len)
    edges = starts + [seq_len]
    sums = np.zeros(len(starts), dtype=np.float64)
    counts = np.zeros(len(starts), dtype=np.int64)
    for ids, labels, *positions in batches:
        if ids.shape[1] != seq_len:
            raise ValueError(f"a batch of {ids.shape[1]} tokens; position-loss compares sequences of seq_len={seq_len}")
        pos = positions[0] if positions else None
        ce = engine.evaluate(ids, labels, progress=progress, per_token=True, position_ids=pos).token_losses.cpu()
        valid = ~torch.isnan(ce)
        at = torch.arange(seq_len).expand_as(ce) if pos is None else pos.cpu()
        for j in range(len(starts)):
            ok = valid & (at >= edges[j]) & (at < edges[j + 1])
            sums[j] += float(ce[ok].double().sum())
            counts[j] += int(ok.sum())
    if not counts.sum():
        raise ValueError("no tokens to evaluate")
    buckets = [{"start": edges[j], "end": edges[j + 1], "tokens": int(counts[j]), "loss": sums[j] / counts[j]}
               for j in range(len(starts)) if counts[j]]
    return {"task": "position-loss", "seq_len": seq_len, "tokens": int(counts.sum()),
            "loss": float(sums.sum() / counts.sum()), "buckets": buckets}


def retrieval(engine: ChunkRecurrentEngine, haystack: np.ndarray | None, codec, lengths: list[int],
              depths: list[float], samples: int = 4, template: str = DEFAULT_TEMPLATE, seed: int = 0,
              batch: int = 0, progress=None) -> dict:
    """Key-value needle retrieval: for each length and depth, `samples` sequences of held-out text
    (sample s of length L: the haystack's window [s L, (s + 1) L)), one needle at the depth and its
    query at the end. `haystack` None: random tokens (tests). batch: sequences per evaluate call
    (0: all samples of a cell at once)."""
    for d in depths:
        if not 0 <= d <= 1:
            raise ValueError(f"--depths {d}: depths are fractions of the context, 0 (start) to 1 (end)")
    need = max(lengths) * samples
    if haystack is not None and len(haystack) < need:
        raise ValueError(f"the haystack file holds {len(haystack):,} tokens; {samples} samples at {max(lengths):,} "
                         f"tokens need {need:,}: use fewer --samples, shorter --lengths or a larger file")
    vocab = engine.adapter.vocab_size
    grid, cells = [], []
    for length in lengths:
        row = []
        for depth in depths:
            seqs, answers = retrieval_cell(haystack, codec, template, length, depth, samples, seed, vocab)
            found, losses = [], []
            step = batch or samples
            for first in range(0, samples, step):
                ids = torch.from_numpy(np.stack(seqs[first : first + step]))
                labels = torch.full_like(ids, IGNORE_INDEX)
                for b, (s0, s1) in enumerate(answers[first : first + step]):
                    labels[b, s0:s1] = ids[b, s0:s1]
                r = engine.evaluate(ids, labels, progress=progress, per_token=True)
                pred, ce = r.predictions.cpu().numpy(), r.token_losses.cpu().numpy()
                for b, span in enumerate(answers[first : first + step]):
                    found += hits(pred[b], ids[b].numpy(), [span])
                    losses.append(float(np.nanmean(ce[b, span[0] : span[1]])))
            accuracy = sum(found) / samples
            row.append(accuracy)
            cells.append({"length": length, "depth": depth, "samples": samples, "hits": int(sum(found)),
                          "accuracy": accuracy, "answer_loss": float(np.mean(losses))})
        grid.append(row)
    return {"task": "retrieval", "lengths": lengths, "depths": depths, "samples": samples, "template": template,
            "accuracy": grid, "mean_accuracy": float(np.mean(grid)), "cells": cells}


def retrieval_cell(haystack: np.ndarray | None, codec, template: str, length: int, depth: float, samples: int,
                   seed: int, vocab: int) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """The sequences of one (length, depth) cell and each one's answer span: sample s hides one
    needle (drawn from a generator seeded by seed, length, depth and s) in the haystack's window
    [s length, (s + 1) length), or in random tokens when there is no haystack."""
    seqs, answers = [], []
    for s in range(samples):
        rng = np.random.default_rng([seed, length, round(depth * 10_000), s])
        text = haystack[s * length : (s + 1) * length] if haystack is not None else rng.integers(0, vocab, length)
        tokens, spans = with_needles(np.asarray(text), [make_needle(codec, template, rng)], [depth], length)
        seqs.append(tokens)
        answers.append(spans[0])
    return seqs, answers


class NeedleHits:
    """An engine probe (ChunkRecurrentEngine.Probe): for each query of a batch's recall pairs, per
    layer and KV head, whether the page holding the needle's value (the token the query must read)
    is visible to the query's block: among its selected pages, or in the query's own chunk."""

    def __init__(self, rows: np.ndarray, a: np.ndarray, b: np.ndarray, buckets: np.ndarray, chunk_size: int,
                 page_size: int, block_queries: int) -> None:
        self.rows, self.b, self.buckets = rows, b, buckets
        self.page = (a + 1) // page_size
        self.chunk_size, self.page_size, self.block_queries = chunk_size, page_size, block_queries
        self.seen: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # layer: [(bucket, (n, Hkv) visible)]

    def __call__(self, c, i, q, k, selection, earlier_keys) -> None:
        if selection is None:
            return
        mine = np.flatnonzero(self.b // self.chunk_size == c)
        if not len(mine):
            return
        picks = selection.logical().long().cpu().numpy()  # (B, Hkv, n_blocks, budget)
        block = (self.b[mine] - c * self.chunk_size) // self.block_queries
        chosen = picks[self.rows[mine], :, block]  # (n, Hkv, budget)
        own = self.page[mine] >= c * self.chunk_size // self.page_size
        visible = (chosen == self.page[mine, None, None]).any(-1) | own[:, None]
        self.seen.setdefault(i, []).append((self.buckets[mine], visible))


def kv_recall(engine: ChunkRecurrentEngine, sequences: list[tuple[np.ndarray, np.ndarray]], task: RecallTask,
              edges: list[int], batch: int = 1, progress=None) -> dict:
    """Accuracy (argmax of the query's next token == the value), its Wilson 95 % interval and the
    answer's mean cross entropy by distance bucket (train/recall.py: bucket_names) over the recall
    pairs of `sequences` (train/recall.py: evaluation_sequences); with top-k, the needle-page hit
    rate of the pairs in different chunks, per layer and KV head and per bucket."""
    vocab = engine.adapter.vocab_size
    tally = Tally(edges)
    seen: dict[int, list] = {}
    sparse = engine.sparse is not None
    for first in range(0, len(sequences), batch):
        ids = np.stack([s[0] for s in sequences[first : first + batch]])
        labels = np.stack([s[1] for s in sequences[first : first + batch]])
        rows, a, b = queries(ids, labels, task, vocab)
        buckets = bucket_of(a, b, engine.chunk_size, edges)
        probe = NeedleHits(rows, a, b, buckets, engine.chunk_size, engine.page_size,
                           engine.sparse.block_queries) if sparse else None
        r = engine.evaluate(torch.from_numpy(ids), torch.from_numpy(labels), progress=progress, per_token=True,
                            probe=probe)
        tally.add(buckets, *answers(r, ids, rows, b))
        if probe is not None:
            for i, parts in probe.seen.items():
                seen.setdefault(i, []).extend(parts)
    if not tally.count.sum():
        raise ValueError("the sequences hold no recall pair")
    result = {"task": "kv-recall", "seq_len": int(sequences[0][0].shape[0]), "edges": edges,
              "buckets": tally.rows(), "chance": 1 / task.values, "queries": int(tally.count.sum()),
              "accuracy": float(tally.found.sum() / tally.count.sum())}
    if sparse:
        result["hit_rate"] = hit_rates(seen, len(tally.names))
    return result


def hit_rates(seen: dict[int, list], n_buckets: int) -> list[dict]:
    """Per layer: the needle-page hit rate of the queries in different chunks (buckets >= 1) per KV
    head and over the heads, and over the heads per bucket."""
    layers = []
    for i in sorted(seen):
        buckets = np.concatenate([bk for bk, _ in seen[i]])
        visible = np.concatenate([v for _, v in seen[i]]).astype(np.float64)  # (n, Hkv)
        far = buckets >= 1
        if not far.any():
            continue
        layers.append({"layer": i, "queries": int(far.sum()), "rate": float(visible[far].mean()),
                       "heads": visible[far].mean(0).tolist(),
                       "by_bucket": [float(visible[buckets == j].mean()) if (buckets == j).any() else None
                                     for j in range(n_buckets)]})
    return layers


class RecallProbe:
    """An engine probe (ChunkRecurrentEngine.Probe) that measures, for sampled query blocks of
    sampled chunks, how much of the exact attention distribution top-k keeps.

    For a query, with p its exact softmax over every key it may see (the earlier pages and the
    chunk's own keys up to itself), `recall` is the mass on what top-k attends (its block's
    selected pages and the chunk's own keys) and `earlier_recall` the share of the mass on
    earlier pages that falls on the selected ones. Earlier keys are read a slice at a time and
    combined by log-sum-exp, so a probe at 1M tokens needs one slice's scores."""

    def __init__(self, chunks: set[int], blocks: int, block_queries: int, page_size: int, scale: float,
                 seed: int = 0, key_slice: int = 32_768) -> None:
        self.chunks, self.blocks, self.block_queries = chunks, blocks, block_queries
        self.page_size, self.scale, self.key_slice = page_size, scale, key_slice
        self.rng = np.random.default_rng(seed)
        self.rows: list[dict] = []  # one per (chunk, layer, block)

    def __call__(self, c, i, q, k, selection, earlier_keys) -> None:
        if selection is None or c not in self.chunks:
            return
        n_blocks = -(-q.shape[2] // self.block_queries)
        picks = sorted(self.rng.choice(n_blocks, min(self.blocks, n_blocks), replace=False).tolist())
        keys = earlier_keys()  # (B, Hkv, n * P, D)
        logical = selection.logical().long()  # (B, Hkv, n_blocks, budget)
        for blk in picks:
            self.rows.append({"chunk": c, "layer": i, "block": blk,
                              **self._block(q, k, keys, logical[:, :, blk], blk)})

    def _block(self, q, k, keys, picks, blk) -> dict:
        b, h, c, d = q.shape
        n_kv = k.shape[1]
        lo, hi = blk * self.block_queries, min(c, (blk + 1) * self.block_queries)
        qb = q[:, :, lo:hi].float().reshape(b, n_kv, h // n_kv, hi - lo, d)
        n_keys = keys.shape[2]
        page_of = torch.arange(n_keys, device=q.device) // self.page_size
        chosen = torch.zeros((b, n_kv, n_keys // self.page_size + 1), dtype=torch.bool, device=q.device)
        chosen.scatter_(2, picks.clamp(max=n_keys // self.page_size), True)
        chosen = chosen[:, :, page_of]  # (B, Hkv, n_keys): key in a selected page
        neg = torch.tensor(float("-inf"), device=q.device)
        lse_all = lse_sel = torch.full(qb.shape[:-1], float("-inf"), device=q.device)
        for s in range(0, n_keys, self.key_slice):
            scores = torch.einsum("bkgqd,bknd->bkgqn", qb, keys[:, :, s : s + self.key_slice].float()) * self.scale
            lse_all = torch.logaddexp(lse_all, scores.logsumexp(-1))
            sel = torch.where(chosen[:, :, None, None, s : s + self.key_slice], scores, neg)
            lse_sel = torch.logaddexp(lse_sel, sel.logsumexp(-1))
        own = torch.einsum("bkgqd,bknd->bkgqn", qb, k[:, :, :hi].float()) * self.scale  # causal: key <= query
        causal = torch.arange(hi, device=q.device)[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]
        lse_own = torch.where(causal, own, neg).logsumexp(-1)
        total = torch.logaddexp(lse_all, lse_own)
        recall = torch.exp(lse_sel - total) + torch.exp(lse_own - total)
        earlier = torch.exp(lse_sel - lse_all)
        return {"recall": float(recall.mean()), "earlier_recall": float(earlier.mean()),
                "earlier_mass": float(torch.exp(lse_all - total).mean())}


def recall_chunks(seq_len: int, chunk_size: int, page_size: int, budget: int, n: int) -> set[int]:
    """Up to n chunks, evenly spread, among those whose earlier pages outnumber the budget (in
    the others top-k keeps every page)."""
    pages = chunk_size // page_size
    eligible = [c for c in range(1, -(-seq_len // chunk_size)) if c * pages > budget]
    if not eligible:
        raise ValueError(f"seq_len={seq_len:,} has no chunk with more than budget={budget} earlier pages: top-k "
                         "keeps every page, recall is 1; use a longer --seq-len")
    if len(eligible) <= n:
        return set(eligible)
    return {eligible[round(j * (len(eligible) - 1) / max(1, n - 1))] for j in range(n)}


def selection_recall(engine: ChunkRecurrentEngine, batches: Batches, seq_len: int, chunks: int = 8,
                     blocks: int = 4, seed: int = 0, progress=None) -> dict:
    """Per layer, the mean recall over sampled query blocks (RecallProbe) of `chunks` chunks per
    sequence. Needs an engine with a sparse policy (sparse=TopKPages(...) or another SparsePolicy)."""
    sparse = engine.sparse
    if sparse is None:
        raise ValueError("selection-recall measures top-k sparse attention: pass --sparse-budget N")
    probe = RecallProbe(recall_chunks(seq_len, engine.chunk_size, engine.page_size, sparse.budget, chunks),
                        blocks, sparse.block_queries, engine.page_size, engine.adapter.scale, seed)
    for ids, labels, *positions in batches:
        if positions:  # the probe's exact attention spans the whole sequence, not each document
            raise ValueError("selection-recall measures attention over whole sequences; packed documents have "
                             "none: evaluate it on a token stream (a .npy/.bin file without a .docs.npy beside it)")
        engine.evaluate(ids, labels, progress=progress, probe=probe)
    layers = []
    for i in sorted({r["layer"] for r in probe.rows}):
        rows = [r for r in probe.rows if r["layer"] == i]
        layers.append({"layer": i, "blocks": len(rows), **{m: float(np.mean([r[m] for r in rows]))
                                                          for m in ("recall", "earlier_recall", "earlier_mass")}})
    if not layers:
        raise ValueError("no query block was sampled (every layer dense?)")
    return {"task": "selection-recall", "seq_len": seq_len, **sparse.describe(),
            "dense_layers": sorted(sparse.dense_set(engine.adapter.n_layers)),
            "recall": float(np.mean([x["recall"] for x in layers])),
            "earlier_recall": float(np.mean([x["earlier_recall"] for x in layers])), "layers": layers,
            "samples": probe.rows}
