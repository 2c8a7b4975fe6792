"""Training data: built-in synthetic long-context tasks, a flat file of token ids, or a document
file (train/documents.py, written by `oomb tokenize`: train/sources.py).

Token files: `.npy` (a 1-D integer array: its dtype travels with it; `oomb tokenize` writes
them), or raw `.bin` (nanoGPT's format) of `uint16` ids, `uint32` for vocabularies above
65,536 (Qwen, Llama 3). The whole file is checked against the model's vocabulary before the
first step.

The built-in `copy` task needs long context to learn: each sequence is tokens drawn from a
Zipf distribution followed by the same tokens again. A model first learns the unigram
distribution (the loss falls from ln(vocab) to its entropy within a few dozen steps), and
the second half is only predictable exactly by attending half a sequence back (an induction
head), which takes longer and drives the loss of the copied half towards zero.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .recall import RecallMix

BIN_DTYPES = ("uint16", "uint32", "int32")
TOKEN_SUFFIXES = (".npy", ".bin")  # oomb tokenize's ids, raw ids (nanoGPT's format)


def copy_weights(vocab_size: int) -> torch.Tensor:
    """The copy task's token distribution (unnormalised): Zipf, exponent 1.1, over every id."""
    return 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64) ** 1.1


def copy_entropy(vocab_size: int) -> float:
    """The unigram entropy of the copy task's tokens (nats): the least loss on the first half,
    whose tokens are drawn independently, and what the copied half costs until it is retrieved."""
    p = copy_weights(vocab_size)
    p = p / p.sum()
    return float(-(p * p.log()).sum())


def copy_halves(token_losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses (B, T) of copy-task sequences (NaN where nothing is predicted) -> the
    (loss sum, tokens) of the first half after its first token, and of the copied half, each
    (2,) float64: the copied half starts at T - T // 2 (copy_task)."""
    start = token_losses.shape[1] - token_losses.shape[1] // 2

    def total(x: torch.Tensor) -> torch.Tensor:
        x = x[~x.isnan()].double()
        return torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])
    return total(token_losses[:, :start]), total(token_losses[:, start:])


def copy_task(vocab_size: int, seq_len: int, batch: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches of the copy task."""
    g = torch.Generator().manual_seed(seed)
    zipf = copy_weights(vocab_size)
    half = seq_len // 2
    while True:
        first = torch.multinomial(zipf, batch * (seq_len - half), replacement=True, generator=g)
        first = first.view(batch, seq_len - half)
        ids = torch.cat([first, first[:, :half]], dim=1)  # (B, seq_len)
        yield ids, ids


def check_token_suffix(source: str, what: str = "") -> None:
    """Refuse, by its name, a source that is neither 'copy' nor a token file (.npy, .bin): text
    or records, whose bytes are no token ids. what: the flag that named it ('--data')."""
    if source != "copy" and Path(source).suffix not in TOKEN_SUFFIXES:
        raise ValueError(f"{what + ' ' if what else ''}{source} is not a token file (.npy or .bin) nor 'copy'; "
                         f"tokenise it first: oomb tokenize {source} --model MODEL --output "
                         f"{Path(source).with_suffix('.npy')} (it reads .txt, .jsonl, .json, .parquet)")


def read_tokens(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """A token file as a read-only 1-D array, checked to be whole integer token ids."""
    path = Path(path)
    check_token_suffix(str(path))
    if path.suffix == ".npy":
        data = np.load(path, mmap_mode="r")
        if data.ndim != 1 or data.dtype.kind not in "iu":
            raise ValueError(f"{path} holds a {data.ndim}-D {data.dtype} array; a 1-D integer array of token ids "
                             "is expected (oomb tokenize writes one)")
    else:
        if dtype not in BIN_DTYPES:
            raise ValueError(f"data_dtype={dtype!r} is not one of {BIN_DTYPES}")
        size, item = path.stat().st_size, np.dtype(dtype).itemsize
        if size % item:
            raise ValueError(f"{path} is {size:,} bytes, not a whole number of {dtype} token ids; "
                             "is --data-dtype right (uint16 or uint32)?")
        data = np.memmap(path, dtype=dtype, mode="r")
    return data


def open_tokens(path: str | Path, vocab_size: int, dtype: str = "uint16") -> np.ndarray:
    """A token file as a read-only 1-D array, checked: whole tokens, ids < vocab_size."""
    path = Path(path)
    data = read_tokens(path, dtype)
    if data.dtype.kind == "i" and len(data) and int(data.min()) < 0:
        at = int(np.argmax(data < 0))
        raise ValueError(f"{path} has token id {int(data[at]):,} < 0 at index {at:,}: token ids are >= 0; it holds "
                         "something else than token ids (oomb tokenize writes them)")
    top = int(data.max()) if len(data) else -1
    if top >= vocab_size:
        hint = " or the file holds uint32 ids: use --data-dtype uint32" if path.suffix != ".npy" else ""
        raise ValueError(f"{path} has token id {top:,} >= the model's vocab_size={vocab_size:,}: it was tokenised "
                         f"for another model{hint}")
    return data


def token_file(data: np.ndarray, seq_len: int, batch: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of seq_len tokens of a 1-D token array (longer than seq_len)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len, size=batch)
        ids = torch.from_numpy(np.stack([data[s : s + seq_len].astype(np.int64) for s in starts]))
        yield ids, ids


def windows(data: np.ndarray, seq_len: int, batch: int, limit: int | None = None
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows of seq_len tokens from the array's start, `batch` at a time (the
    same every run: evaluation). (len - 1) // seq_len windows, at most `limit`; the last batch
    may be smaller."""
    n = (len(data) - 1) // seq_len if limit is None else min(limit, (len(data) - 1) // seq_len)
    for first in range(0, n, batch):
        ids = torch.from_numpy(np.stack([data[w * seq_len : (w + 1) * seq_len].astype(np.int64)
                                         for w in range(first, min(n, first + batch))]))
        yield ids, ids


def load_tokens(source: str, vocab_size: int, seq_len: int, dtype: str = "uint16", what: str = "--data") -> np.ndarray:
    """A token file, checked, with at least one window of seq_len tokens (seq_len + 1 of them)."""
    if not Path(source).is_file():
        raise ValueError(f"{what} {source!r} is neither 'copy' (built-in) nor a file of token ids (.npy or .bin)")
    data = open_tokens(source, vocab_size, dtype)
    if len(data) <= seq_len:
        raise ValueError(f"{source} holds {len(data):,} tokens, fewer than seq_len={seq_len:,} + 1; "
                         "use a shorter --seq-len or more data")
    return data


def make_data(source: str, vocab_size: int, seq_len: int, batch: int, seed: int = 0, dtype: str = "uint16",
              needles=None, pack: bool | None = None, drop_long: bool = False):
    """Endless training batches of `source`: 'copy', a token file (random windows), or a document
    file (train/documents.py: `pack`ed, or one document per sequence; pack=None packs chat data
    and takes windows of text). (input_ids, labels), packed (input_ids, labels, position_ids).
    `needles` (NeedleMix) puts key-value needles into a share of the windows."""
    from .documents import data_layout, document_batches, open_documents

    how = data_layout(source, pack)
    if how != "windows":
        if needles is not None:
            raise ValueError(f"needles go into windows of a token stream; {source} is trained as documents "
                             f"({how}): drop --needle-rate, or train on its windows (leave out --pack/--no-pack)")
        return document_batches(open_documents(source, vocab_size), seq_len, batch, seed, how == "packed", drop_long)
    if source == "copy":
        stream = copy_task(vocab_size, seq_len, batch, seed)
    else:
        tokens = load_tokens(source, vocab_size, seq_len, dtype)
        if isinstance(needles, RecallMix):
            needles.task.check_text(tokens, vocab_size, source)
        stream = token_file(tokens, seq_len, batch, seed)
    return stream if needles is None else needles.mix(stream, seed)


class NeedleMix:
    """A share `rate` of the sequences carry `per_sequence` key-value needles at random depths and
    their queries at the end (train/needles.py), so that retrieval over the whole context is
    learnable from scratch; the others are left as they are."""

    def __init__(self, codec, template: str, rate: float, per_sequence: int = 4) -> None:
        from .needles import check_template

        if not 0 < rate <= 1:
            raise ValueError(f"needle_rate={rate} must be in (0, 1]")
        if per_sequence < 1:
            raise ValueError(f"needles per sequence={per_sequence} must be >= 1")
        check_template(template)
        self.codec, self.template, self.rate, self.per_sequence = codec, template, rate, per_sequence

    def mix(self, stream, seed: int):
        from .needles import make_needle, with_needles

        rng = np.random.default_rng([seed, 7_741])
        for ids, labels in stream:
            ids = ids.clone()
            for b in range(ids.shape[0]):
                if rng.random() >= self.rate:
                    continue
                needles = [make_needle(self.codec, self.template, rng) for _ in range(self.per_sequence)]
                row, _ = with_needles(ids[b].numpy(), needles, list(rng.random(self.per_sequence)), ids.shape[1])
                ids[b] = torch.from_numpy(row)
            yield ids, ids
