"""Training data: built-in synthetic long-context tasks, or a flat file of token ids.

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



def copy_task(vocab_size: int, seq_len: int, batch: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches of the copy task."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64) ** 1.1
    half = seq_len // 2
    while True:
        first = torch.multinomial(zipf, batch * (seq_len - half), replacement=True, generator=g)
        first = first.view(batch, seq_len - half)
        ids = torch.cat([first, first[:, :half]], dim=1)  # (B, seq_len)
        yield ids, ids


def token_file(path: str | Path, seq_len: int, batch: int, seed: int = 0,
               dtype: str = "uint16") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows of a flat binary file of token ids (nanoGPT's .bin format)."""
    data = np.memmap(path, dtype=dtype, mode="r")
    if len(data) <= seq_len:
        raise ValueError(f"{path} holds {len(data)} tokens, fewer than seq_len={seq_len} + 1; use a shorter --seq-len")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len, size=batch)
        ids = torch.from_numpy(np.stack([data[s : s + seq_len].astype(np.int64) for s in starts]))
        yield ids, ids


def make_data(source: str, vocab_size: int, seq_len: int, batch: int, seed: int = 0):
    if source == "copy":
        return copy_task(vocab_size, seq_len, batch, seed)
    if not Path(source).is_file():
        raise ValueError(f"--data {source!r} is neither 'copy' (built-in) nor a file of token ids")
    return token_file(source, seq_len, batch, seed)
