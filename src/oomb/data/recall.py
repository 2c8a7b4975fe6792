"""Associative recall in real text: single-token keys and values from ids the text never uses.

A pair is a key id K and a value id V. Its *needle* (K then V) sits somewhere in a sequence of
text, and its *query* (K again) sits later; the token after the query is V, and predicting it
needs the needle, however far back (an induction head: find the earlier K, copy what followed
it). Keys and values are one token each, drawn from ids reserved at the top of the vocabulary
(by default), so nothing in the text can stand for them and the value is chance (1 / values)
without the needle. Each sequence's keys are distinct; each pair is queried once.

Labels: the text keeps its own (language modelling goes on); of the four recall tokens only the
query's value is a target, since the needle's key, its value and the query's key are random.

Training sequences carry `pairs` pairs at needle-to-query distances drawn half log-uniformly
(every scale from 2 tokens to the whole sequence alike) and half uniformly (most pairs far
apart); evaluation sequences place equal numbers of pairs in each distance bucket (eval/kv_recall.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from ..loss import IGNORE_INDEX

MIN_DISTANCE = 2  # the query's key right after the needle's value


@dataclass(frozen=True)
class RecallTask:
    keys: int = 256  # distinct key ids (>= the pairs of a sequence)
    values: int = 256  # distinct value ids: chance is 1 / values
    first_id: int | None = None  # the first key id (values follow the keys); None: the top of the vocabulary

    def __post_init__(self) -> None:
        for name in ("keys", "values"):
            if getattr(self, name) < 2:
                raise ValueError(f"recall_{name}={getattr(self, name)} must be >= 2")
        if self.first_id is not None and self.first_id < 0:
            raise ValueError(f"recall_first_id={self.first_id} must be >= 0 (or unset: the top of the vocabulary)")

    def first(self, vocab_size: int) -> int:
        """The first reserved id for a model of this vocabulary, checked to fit."""
        first = vocab_size - self.keys - self.values if self.first_id is None else self.first_id
        if first < 1 or first + self.keys + self.values > vocab_size:
            raise ValueError(f"{self.keys} key and {self.values} value ids from id {first} do not fit a vocabulary of "
                             f"{vocab_size:,}: use fewer --recall-keys/--recall-values, or a model with unused ids "
                             "(the byte-kv-30m preset has 256 of each above its 256 bytes)")
        return first

    def check_text(self, data: np.ndarray, vocab_size: int, source: str) -> None:
        """Refuse text that uses the reserved ids (a needle would then be ambiguous)."""
        top = int(data.max()) if len(data) else -1
        first = self.first(vocab_size)
        if top >= first:
            raise ValueError(f"{source} uses token id {top:,}, which the recall task reserves (ids {first:,} .. "
                             f"{first + self.keys + self.values - 1:,}): set --recall-first-id above the text's ids, "
                             "or use a model with unused ids above them")

    def pair_ids(self, vocab_size: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """n distinct keys and n values (values may repeat)."""
        if n > self.keys:
            raise ValueError(f"{n} pairs in one sequence need as many distinct keys; recall_keys={self.keys}")
        first = self.first(vocab_size)
        keys = first + rng.choice(self.keys, n, replace=False)
        values = first + self.keys + rng.integers(0, self.values, n)
        return keys.astype(np.int64), values.astype(np.int64)


def training_distances(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """n needle-to-query distances for a sequence of `length`: half log-uniform in [2, length - 2],
    half uniform."""
    top = length - 2
    if top < MIN_DISTANCE:
        raise ValueError(f"a sequence of {length} tokens holds no recall pair (4 tokens)")
    log = np.exp(rng.uniform(math.log(MIN_DISTANCE), math.log(top + 1), n)).astype(np.int64)
    uniform = rng.integers(MIN_DISTANCE, top + 1, n)
    d = np.where(rng.random(n) < 0.5, log, uniform)
    return np.clip(d, MIN_DISTANCE, top)


def place(length: int, distances: np.ndarray, rng: np.random.Generator, accept=None, redraw=None,
          tries: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Positions of each pair's needle (key at a, value at a + 1) and query (key at b = a + d, value
    at b + 1) in a sequence of `length`, no two pairs' tokens overlapping. accept: per pair, None or
    a condition accept[j](a, b) its placement must meet (evaluation: the pair's chunks). redraw():
    a new distance for a pair that finds no room (training); without it such a pair is an error."""
    taken = np.zeros(length, dtype=bool)
    a_out, b_out = np.empty(len(distances), np.int64), np.empty(len(distances), np.int64)
    for j in np.argsort(-np.asarray(distances), kind="stable"):  # the longest first: they have the least room
        d = int(distances[j])
        ok = accept[j] if accept is not None else None
        for t in range(tries):
            if redraw is not None and t and t % 20 == 0:
                d = int(redraw())
            a = int(rng.integers(0, length - 1 - d))  # b + 1 = a + d + 1 <= length - 1
            b = a + d
            if not (taken[a] or taken[a + 1] or taken[b] or taken[b + 1]) and (ok is None or ok(a, b)):
                break
        else:
            raise ValueError(f"no room for recall pair {j} (distance {d}) in {length} tokens after {tries} tries: "
                             "use fewer pairs per sequence")
        taken[[a, a + 1, b, b + 1]] = True
        a_out[j], b_out[j] = a, b
    return a_out, b_out


def compose(text: np.ndarray, keys: np.ndarray, values: np.ndarray, a: np.ndarray, b: np.ndarray,
            length: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, labels) of `length`: the recall tokens at their positions, the text's first
    length - 4 n tokens in order around them; labels: the text's and each query's value."""
    ids = np.empty(length, dtype=np.int64)
    labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
    recall = np.zeros(length, dtype=bool)
    for pos, tok in ((a, keys), (a + 1, values), (b, keys), (b + 1, values)):
        ids[pos] = tok
        recall[pos] = True
    rest = ~recall
    need = int(rest.sum())
    if len(text) < need:
        raise ValueError(f"the text holds {len(text):,} tokens, {need:,} are needed")
    ids[rest] = text[:need]
    labels[rest] = ids[rest]
    labels[b + 1] = values
    return ids, labels


class RecallMix:
    """Puts `pairs` recall pairs into every sequence of a stream of text windows (train/data.py)."""

    def __init__(self, task: RecallTask, pairs: int, vocab_size: int) -> None:
        if pairs < 1:
            raise ValueError(f"recall_pairs={pairs} must be >= 1")
        task.pair_ids(vocab_size, pairs, np.random.default_rng(0))  # the ids fit the vocabulary, enough keys
        self.task, self.pairs, self.vocab = task, pairs, vocab_size

    def sequence(self, text: np.ndarray, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        keys, values = self.task.pair_ids(self.vocab, self.pairs, rng)
        a, b = place(length, training_distances(rng, self.pairs, length), rng,
                     redraw=lambda: training_distances(rng, 1, length)[0])
        return compose(text, keys, values, a, b, length)

    def mix(self, stream, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rng = np.random.default_rng([seed, 4_051])
        for ids, _ in stream:
            rows = [self.sequence(row.numpy(), ids.shape[1], rng) for row in ids]
            yield (torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))


# -- evaluation: equal numbers of pairs in each distance bucket --------------------------------

def bucket_names(edges: list[int]) -> list[str]:
    """Bucket 0: needle and query in one chunk; bucket j >= 1: in different chunks, distance in
    [edges[j - 1], edges[j])."""
    def k(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)
    return ["same chunk"] + [f"{k(lo)}-{k(hi)}" for lo, hi in zip(edges, edges[1:])]


def check_edges(edges: list[int], length: int, chunk_size: int) -> list[int]:
    """Distance bucket edges, from 0, increasing, the last at most the longest distance."""
    if not edges or edges[0] != 0 or any(x >= y for x, y in zip(edges, edges[1:])) or len(edges) < 2:
        raise ValueError(f"distance buckets {edges}: edges must start at 0 and increase, e.g. 0,4K,16K,32K,64K")
    if edges[-1] > length:
        raise ValueError(f"distance bucket edge {edges[-1]:,} is beyond a sequence of {length:,} tokens: end the "
                         "buckets at --seq-len or below")
    if chunk_size < 4:
        raise ValueError(f"chunk_size={chunk_size} holds no recall pair")
    return edges


def bucket_of(a: np.ndarray, b: np.ndarray, chunk_size: int, edges: list[int]) -> np.ndarray:
    """Each pair's bucket (bucket_names), -1 for a distance beyond the last edge."""
    d = b - a
    j = np.searchsorted(np.asarray(edges), d, side="right")  # 1 .. len(edges): [edges[j-1], edges[j])
    j = np.where(d >= edges[-1], -1, j)
    return np.where(a // chunk_size == b // chunk_size, 0, j)


def evaluation_sequences(haystack: np.ndarray | None, task: RecallTask, vocab_size: int, length: int,
                         chunk_size: int, edges: list[int], per_bucket: int, pairs: int, seed: int = 0
                         ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) sequences holding `per_bucket` pairs of every bucket, `pairs` a sequence
    (buckets in turn), sequence s in the haystack's window [s length, (s + 1) length) (random
    text ids below the reserved ones when there is no haystack: tests)."""
    check_edges(edges, length, chunk_size)
    n_buckets = len(edges)
    want = [j % n_buckets for j in range(per_bucket * n_buckets)]
    n_seq = -(-len(want) // pairs)
    if haystack is not None and len(haystack) < n_seq * length:
        raise ValueError(f"the held-out text holds {len(haystack):,} tokens; {n_seq} sequences of {length:,} are "
                         f"needed ({per_bucket} queries in each of {n_buckets} buckets, {pairs} a sequence): use "
                         "fewer --queries, more --recall-pairs a sequence or a larger file")
    first = task.first(vocab_size)
    seqs = []
    for s in range(n_seq):
        rng = np.random.default_rng([seed, length, s])
        mine = want[s * pairs : (s + 1) * pairs]
        distances, accept = [], []
        for j in mine:
            if j == 0:
                distances.append(int(rng.integers(MIN_DISTANCE, min(chunk_size, length) - 1)))
                accept.append(lambda a, b: a // chunk_size == b // chunk_size)
            else:
                lo, hi = max(edges[j - 1], MIN_DISTANCE), min(edges[j], length - 1)
                distances.append(int(rng.integers(lo, hi)))
                accept.append(lambda a, b: a // chunk_size != b // chunk_size)
        text = haystack[s * length : (s + 1) * length] if haystack is not None else rng.integers(0, first, length)
        keys, values = task.pair_ids(vocab_size, len(mine), rng)
        a, b = place(length, np.asarray(distances), rng, accept)
        seqs.append(compose(np.asarray(text), keys, values, a, b, length))
    return seqs


def default_edges(seq_len: int) -> list[int]:
    """0, 4K, 16K, 32K, then doubling, below seq_len; the last edge seq_len."""
    steps = [4096, 16384] + [32768 * 2**k for k in range(8)]
    return [0] + [e for e in steps if e < seq_len] + [seq_len]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k / n (95 % for z = 1.96)."""
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)


class Tally:
    """Queries, hits and answer cross entropy by distance bucket."""

    def __init__(self, edges: list[int]) -> None:
        self.names = bucket_names(edges)
        self.found = np.zeros(len(self.names), np.int64)
        self.count = np.zeros(len(self.names), np.int64)
        self.loss = np.zeros(len(self.names), np.float64)

    def add(self, buckets: np.ndarray, ok: np.ndarray, ce: np.ndarray) -> None:
        for j in range(len(self.names)):
            at = buckets == j
            self.found[j] += int(ok[at].sum())
            self.count[j] += int(at.sum())
            self.loss[j] += float(ce[at].astype(np.float64).sum())

    def rows(self) -> list[dict]:
        out = []
        for j, name in enumerate(self.names):
            n = int(self.count[j])
            lo, hi = wilson(int(self.found[j]), n)
            out.append({"bucket": name, "queries": n, "hits": int(self.found[j]),
                        "accuracy": self.found[j] / n if n else float("nan"), "ci_low": lo, "ci_high": hi,
                        "answer_loss": self.loss[j] / n if n else float("nan")})
        return out


def answers(result, ids: np.ndarray, rows: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of an engine's evaluate(per_token=True) result: whether each query's value (at b + 1 of
    its row) was the argmax prediction, and its cross entropy."""
    pred = result.predictions.cpu().numpy()[rows, b + 1]
    return pred == ids[rows, b + 1], result.token_losses.cpu().numpy()[rows, b + 1]


def queries(ids: np.ndarray, labels: np.ndarray, task: RecallTask, vocab_size: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The recall pairs of a batch, read from its tokens alone: (row, needle position a, query
    position b) of every query (a target that is a value id, after a key id), a the key's first
    position in the row."""
    first = task.first(vocab_size)
    values_lo = first + task.keys
    rows, a_out, b_out = [], [], []
    for r in range(ids.shape[0]):
        target = np.flatnonzero((labels[r, 1:] >= values_lo) & (labels[r, 1:] < values_lo + task.values)) + 1
        b = target - 1
        b = b[(ids[r, b] >= first) & (ids[r, b] < values_lo)]
        if not len(b):
            continue
        key_pos = np.flatnonzero((ids[r] >= first) & (ids[r] < values_lo))
        first_at = {}
        for p in key_pos[::-1]:
            first_at[int(ids[r, p])] = int(p)
        a = np.asarray([first_at[int(ids[r, p])] for p in b])
        keep = a < b  # a query whose key never came before has no needle
        rows.append(np.full(int(keep.sum()), r))
        a_out.append(a[keep])
        b_out.append(b[keep])
    if not rows:
        return (np.empty(0, np.int64),) * 3
    return np.concatenate(rows), np.concatenate(a_out), np.concatenate(b_out)
