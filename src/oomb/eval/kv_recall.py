"""`--task kv-recall`: single-token key-value pairs (oomb.data.recall) at equal numbers in each
needle-to-query distance bucket: accuracy with its 95 % interval and the answer's loss by bucket;
top-k reads also the needle-page hit rate (is the needle's page among those the query's block
attends), per layer and KV head."""
from __future__ import annotations

import argparse

import numpy as np
import torch

from ..data.recall import RecallTask, Tally, answers, bucket_of, queries
from ..engine import ChunkRecurrentEngine
from ..flags import at_least
from ..units import parse_tokens
from .registry import EvalTask


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



def run(args: argparse.Namespace, engine: ChunkRecurrentEngine, progress) -> dict:
    """Recall pairs in equal numbers per distance bucket, in the held-out text (random tokens for 'copy')."""
    from ..data.recall import default_edges, evaluation_sequences
    from ..data.tokens import load_tokens

    vocab = engine.adapter.vocab_size
    task = RecallTask(args.recall_keys, args.recall_values, args.recall_first_id)
    edges = args.distance_buckets or default_edges(args.seq_len)
    haystack = None
    if args.data != "copy":
        haystack = load_tokens(args.data, vocab, args.seq_len, args.data_dtype)
        task.check_text(haystack, vocab, args.data)
    sequences = evaluation_sequences(haystack, task, vocab, args.seq_len, args.chunk_size, edges, args.queries,
                                     args.recall_pairs, args.seed)
    return kv_recall(engine, sequences, task, edges, args.batch, progress)


def report(r: dict) -> list[str]:
    lines = [f"accuracy {r['accuracy']:.3f} over {r['queries']:,} queries (chance {r['chance']:.4f}); "
             "by needle-to-query distance:"]
    for b in r["buckets"]:
        lines.append(f"  {b['bucket']:>12}  {b['queries']:>6,} queries  accuracy {b['accuracy']:.3f} "
                     f"[{b['ci_low']:.3f}, {b['ci_high']:.3f}]  answer loss {b['answer_loss']:.4f}")
    for x in r.get("hit_rate", []):
        heads = " ".join(f"{h:.2f}" for h in x["heads"])
        lines.append(f"  layer {x['layer']:>3}  needle-page hit rate {x['rate']:.3f} (KV heads {heads})")
    return lines


TASK = EvalTask(
    "kv-recall", "key-value recall by needle-to-query distance",
    run=run, report=report,
    settings={"recall_keys": {}, "recall_values": {}, "recall_first_id": {},
              # it scores recall pairs, so it needs some (train's 0 means no recall task)
              "recall_pairs": {"default": 64, "type": at_least(1)}},
    flags={"--queries": {"type": at_least(1), "default": 256, "help": "queries in each distance bucket"},
           "--distance-buckets": {
               "type": lambda t: [parse_tokens(x, 0) for x in t.split(",")], "default": None,
               "help": "needle-to-query distance edges, e.g. 0,4K,16K,32K,64K (default: 0, 4K, 16K, 32K, then "
                       "doubling, up to seq_len); pairs within one chunk are a bucket of their own"}})
