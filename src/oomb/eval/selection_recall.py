"""`--task selection-recall`: for top-k models, the share of the exact softmax attention mass that
falls on what top-k attends (its selected pages and the chunk itself), per layer."""
from __future__ import annotations

import numpy as np
import torch

from ..engine import ChunkRecurrentEngine
from ..flags import at_least
from .inputs import BATCHES, Batches, eval_batches
from .registry import EvalTask


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


def report(r: dict) -> list[str]:
    return [f"recall {r['recall']:.4f}, of the earlier pages' mass {r['earlier_recall']:.4f}"] + [
        f"  layer {x['layer']:>3}  recall {x['recall']:.4f}  earlier {x['earlier_recall']:.4f}  ({x['blocks']} blocks)"
        for x in r["layers"]]


def plot(result: dict, label: str, path: str) -> None:
    from . import plots

    plots.selection_recall({label: result}, path)


TASK = EvalTask(
    "selection-recall", "top-k's share of the exact attention mass, per layer",
    run=lambda args, engine, progress: selection_recall(engine, eval_batches(args, engine.adapter.vocab_size),
                                                        args.seq_len, args.recall_chunks, args.recall_blocks,
                                                        args.seed, progress),
    report=report, plot=plot,
    flags={"--batches": BATCHES,
           "--recall-chunks": {"type": at_least(1), "default": 8, "help": "chunks sampled per sequence"},
           "--recall-blocks": {"type": at_least(1), "default": 4, "help": "query blocks per chunk"}})
