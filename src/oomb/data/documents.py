"""Document files: token ids with each document's start (and, for chat data, which tokens are
trained), as `oomb tokenize` writes them; the trainer's sequences of them, packed or one each.

On disk, beside the ids `NAME.npy` (1-D uint16 or uint32: the documents one after another, a
plain token file that every token-file reader takes as before):

    NAME.docs.npy   (D,) int64: each document's first index into the ids; ascending, from 0
    NAME.mask.npy   (N,) bool, as long as the ids: True where a token is trained (chat data: the
                    assistant turns' tokens); absent: every token is trained (text)

All three are read memory-mapped. A training sequence is made of whole documents:

- packed (`--pack`, the default for data with a mask): documents, longest first, each into the
  sequence with the least room that fits it (best-fit decreasing), so every sequence is whole
  documents; the room left at its end is one more document of pad tokens (id 0, no loss).
  `position_ids` restart at 0 at each document (transformers' DataCollatorWithFlattening).
- one document per sequence (`--no-pack`): padded to seq_len with pad tokens (id 0, no loss),
  which come after it and so are never attended by it.

Labels are per input position, shifted inside the engine as in transformers (position t is
trained to predict labels[t + 1]): a document's first label is -100, so the last token of one
document never predicts the first of the next, and neither does a pad. A document longer than
seq_len is cut to its first seq_len tokens (one warning counts them) or, with drop_long, left
out; so is a document left with no trained token.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..loss import IGNORE_INDEX
from .tokens import read_tokens

PAD_ID = 0  # pad tokens carry no loss and are attended by no document's token


def sibling(path: str | Path, kind: str) -> Path:
    """tokens.npy -> tokens.docs.npy (kind 'docs') or tokens.mask.npy (kind 'mask')."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{kind}.npy")


def has_documents(source: str) -> bool:
    return source.endswith(".npy") and sibling(source, "docs").is_file()


def data_layout(source: str, pack: bool | None) -> str:
    """How the trainer cuts `source` into sequences: 'windows' (random windows of a token stream,
    as for any token file), 'packed' or 'documents' (one document per sequence). pack=None: packed
    when the file has a mask (chat data), else windows."""
    if not has_documents(source):
        if pack is not None:
            why = "the built-in copy task has none" if source == "copy" else \
                f"{source!r} has no {sibling(source, 'docs').name} beside it (oomb tokenize writes one)"
            raise ValueError(f"--{'' if pack else 'no-'}pack needs a document file: {why}; leave the flag out to "
                             "train on windows of a token stream")
        return "windows"
    if pack is None:
        return "packed" if sibling(source, "mask").is_file() else "windows"
    return "packed" if pack else "documents"


@dataclass(frozen=True)
class Documents:
    path: str
    ids: np.ndarray  # (N,) token ids
    starts: np.ndarray  # (D,) int64, each document's first index into ids
    lengths: np.ndarray  # (D,) int64, its tokens
    mask: np.ndarray | None  # (N,) bool, True where a token is trained; None: every token

    def trained(self, d: int, length: int) -> bool:
        """Whether document d's first `length` tokens train any token (its first never is)."""
        if length < 2:
            return False
        s = int(self.starts[d])
        return self.mask is None or bool(self.mask[s + 1 : s + length].any())


def write_documents(output: str, ids: np.ndarray, starts: np.ndarray, mask: np.ndarray | None) -> None:
    """The ids, their document starts and mask (None: no mask file; a stale one is removed), each
    written whole and then renamed; the ids last."""
    assert len(starts) and starts[0] == 0 and (mask is None or len(mask) == len(ids))
    out = Path(output)
    files = [(sibling(out, "docs"), starts.astype(np.int64))]
    if mask is not None:
        files.append((sibling(out, "mask"), mask.astype(bool)))
    else:
        sibling(out, "mask").unlink(missing_ok=True)
    files.append((out, ids))
    for path, array in files:
        tmp = path.with_name(path.name + ".tmp.npy")  # never a half-written file under the real name
        np.save(tmp, array)
        tmp.replace(path)


def open_documents(path: str, vocab_size: int) -> Documents:
    """A document file, checked: starts ascending from 0 inside the ids, a mask as long as the ids,
    ids < vocab_size (else an error naming the first document with one)."""
    ids = read_tokens(path)
    docs = sibling(path, "docs")
    starts = np.load(docs, mmap_mode="r")
    rewrite = "; it was not written with these ids: run oomb tokenize again"
    if starts.ndim != 1 or starts.dtype.kind not in "iu" or not len(starts):
        raise ValueError(f"{docs} holds a {starts.ndim}-D {starts.dtype} array of {starts.size} values; document "
                         f"starts are a non-empty 1-D integer array{rewrite}")
    if starts[0] != 0 or starts[-1] >= len(ids) or (len(starts) > 1 and not (np.diff(starts) > 0).all()):
        raise ValueError(f"{docs}: document starts must ascend from 0 and stay below the {len(ids):,} ids of "
                         f"{path}{rewrite}")
    mask = None
    if sibling(path, "mask").is_file():
        mask = np.load(sibling(path, "mask"), mmap_mode="r")
        if mask.dtype != bool or mask.shape != ids.shape:
            raise ValueError(f"{sibling(path, 'mask')} holds a {mask.dtype} array of shape {mask.shape}; a bool "
                             f"array as long as the {len(ids):,} ids is expected{rewrite}")
    if ids.dtype.kind == "i" and len(ids) and int(ids.min()) < 0:
        at = int(np.argmax(ids < 0))
        d = int(np.searchsorted(starts, at, side="right")) - 1
        raise ValueError(f"{path}: document {d:,} (from token {int(starts[d]):,}) has token id {int(ids[at]):,} < 0: "
                         "token ids are >= 0; run oomb tokenize again")
    if len(ids) and int(ids.max()) >= vocab_size:
        at = int(np.argmax(ids >= vocab_size))
        d = int(np.searchsorted(starts, at, side="right")) - 1
        raise ValueError(f"{path}: document {d:,} (from token {int(starts[d]):,}) has token id {int(ids[at]):,} >= "
                         f"the model's vocab_size={vocab_size:,}: it was tokenised for another model")
    starts = np.asarray(starts, dtype=np.int64)
    return Documents(str(path), ids, starts, np.diff(starts, append=len(ids)), mask)


def best_fit_decreasing(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Indices of `lengths` (each <= seq_len) grouped into sequences of at most seq_len tokens:
    longest first (ties in index order), each into the sequence with the least room that fits
    it, else a new one. The rooms are found in a max-tree over room sizes 0..seq_len (leaf r
    holds r while some sequence has r tokens of room, else 0): O(log seq_len) per document."""
    size = 1 << int(seq_len).bit_length()  # leaves for rooms 0..seq_len
    tree = [0] * (2 * size)
    with_room: dict[int, list[int]] = {}  # room -> the sequences that have exactly that much left

    def set_leaf(room: int, value: int) -> None:
        i = size + room
        tree[i] = value
        while i > 1:
            i //= 2
            tree[i] = max(tree[2 * i], tree[2 * i + 1])

    sequences: list[list[int]] = []
    for d in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[d])
        if tree[1] >= n:  # the smallest room >= n: go left wherever the left subtree has one
            i = 1
            while i < size:
                i = 2 * i if tree[2 * i] >= n else 2 * i + 1
            room = i - size
            s = with_room[room].pop()
            if not with_room[room]:
                del with_room[room]
                set_leaf(room, 0)
        else:
            s, room = len(sequences), seq_len
            sequences.append([])
        sequences[s].append(d)
        room -= n
        if room:
            if room not in with_room:
                with_room[room] = []
                set_leaf(room, room)
            with_room[room].append(s)
    return [sorted(s) for s in sequences]  # each sequence's documents in file order


def plan_sequences(docs: Documents, seq_len: int, pack: bool, drop_long: bool = False) -> list[list[int]]:
    """The documents of each training sequence (indices into docs.starts), in a fixed order. One
    warning counts the documents longer than seq_len (cut, or left out with drop_long) and those
    left without a trained token."""
    lengths = docs.lengths
    long = lengths > seq_len
    kept = np.flatnonzero(~long) if drop_long else np.arange(len(lengths))
    trained = np.array([docs.trained(d, min(int(lengths[d]), seq_len)) for d in kept.tolist()], dtype=bool)
    untrained, kept = int((~trained).sum()), kept[trained]
    notes = []
    if long.any():
        notes.append(f"{int(long.sum()):,} of {len(lengths):,} documents are longer than seq_len={seq_len:,} "
                     + ("and are left out (--drop-long)" if drop_long else
                        f"and are cut to their first {seq_len:,} tokens (--drop-long leaves them out)"))
    if untrained:
        notes.append(f"{untrained:,} documents have no trained token within seq_len and are left out")
    if not len(kept):
        raise ValueError(f"{docs.path}: no document is left to train on ({'; '.join(notes)}); use a longer --seq-len")
    if notes:
        warnings.warn(f"{docs.path}: {'; '.join(notes)}", stacklevel=2)
    if not pack:
        return [[d] for d in kept.tolist()]
    return [[int(kept[i]) for i in s] for s in best_fit_decreasing(np.minimum(lengths[kept], seq_len), seq_len)]


def sequence(docs: Documents, members: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One training sequence of documents `members`, then pads: (input_ids, labels, position_ids),
    each (seq_len,) int64."""
    ids = np.full(seq_len, PAD_ID, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    positions = np.empty(seq_len, dtype=np.int64)
    at = 0
    for d in members:
        s = int(docs.starts[d])
        n = min(int(docs.lengths[d]), seq_len - at)
        ids[at : at + n] = docs.ids[s : s + n]
        labels[at + 1 : at + n] = ids[at + 1 : at + n]  # the first stays -100: no target across documents
        if docs.mask is not None:
            labels[at : at + n][~docs.mask[s : s + n]] = IGNORE_INDEX
        positions[at : at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(seq_len - at)  # the pads: a document of their own
    return ids, labels, positions


def document_batches(docs: Documents, seq_len: int, batch: int, seed: int, pack: bool, drop_long: bool = False
                     ) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless batches of training sequences, each pass over them in another random order:
    (input_ids, labels, position_ids) when packed, (input_ids, labels) with one document per
    sequence; each (batch, seq_len) int64. The sequences are planned (and refused) now, before
    the first batch is asked for."""
    return _batches(docs, plan_sequences(docs, seq_len, pack, drop_long), seq_len, batch, seed, pack)


def evaluation_batches(docs: Documents, seq_len: int, batch: int, limit: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The first `limit` packed sequences in plan order (the same every run: evaluation), `batch`
    at a time: (input_ids, labels, position_ids), each document attending to itself only and
    its targets masked as in training; the last batch may be smaller."""
    plan = plan_sequences(docs, seq_len, pack=True)[:limit]
    for first in range(0, len(plan), batch):
        yield _stack([sequence(docs, members, seq_len) for members in plan[first : first + batch]])


def _stack(rows: list[tuple[np.ndarray, ...]]) -> tuple[torch.Tensor, ...]:
    """Rows of (input_ids, labels, position_ids) as (batch, seq_len) tensors of each."""
    return tuple(torch.from_numpy(np.stack(x)) for x in zip(*rows))


def _batches(docs: Documents, plan: list[list[int]], seq_len: int, batch: int, seed: int, pack: bool):
    rng = np.random.default_rng(seed)
    rows = []
    while True:
        for i in rng.permutation(len(plan)).tolist():
            rows.append(sequence(docs, plan[i], seq_len))
            if len(rows) == batch:
                ids, labels, positions = _stack(rows)
                rows = []
                yield (ids, labels, positions) if pack else (ids, labels)
