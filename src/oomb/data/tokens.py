"""Token sources that training and evaluation both read: the built-in copy task, and token files
(`.npy`: a 1-D integer array, its dtype travels with it, as `oomb tokenize` writes them; raw `.bin`,
nanoGPT's format, of `uint16` ids, `uint32` for vocabularies above 65,536: Qwen, Llama 3), checked
against the model's vocabulary before the first step; evaluation reads their first windows.

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
