"""Training data: built-in synthetic long-context tasks, or a flat file of token ids.

The built-in `copy` task needs long context to learn: each sequence is random tokens
followed by the same tokens again, so the second half can only be predicted by attending
half a sequence back. Its loss falls from ln(vocab) towards ln(vocab)/2 as that is learnt.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..loss import IGNORE_INDEX


def copy_task(vocab_size: int, seq_len: int, batch: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, labels) batches of the copy task; labels score only the copy."""
    g = torch.Generator().manual_seed(seed)
    half = seq_len // 2
    while True:
        first = torch.randint(0, vocab_size, (batch, seq_len - half), generator=g)
        ids = torch.cat([first, first[:, :half]], dim=1)  # (B, seq_len)
        labels = ids.clone()
        labels[:, : seq_len - half] = IGNORE_INDEX  # the random half cannot be predicted
        yield ids, labels


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
