"""Packed documents: several documents in one sequence, each attending only to itself.

A document starts wherever `position_ids` restart at 0 (transformers' DataCollatorWithFlattening
convention) and its positions then grow by 1 a token. Attention reads two per-token tensors:

    key_start[b, t] = t - position_ids[b, t]     the document's first token (absolute position)
    doc_end[b, t]   = the next document's start  one past its last token (T for the last one)

Query t sees key j iff key_start[t] <= j <= t. key_start never decreases along a sequence, so
the first query of a tile has the tile's smallest key_start: keys before it are skipped by
every query of the tile (pages and key tiles wholly in finished documents are not read); the
queries that can see key j are j .. doc_end[j] - 1, so a key tile's backward visits the query
tiles up to its last key's doc_end only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Documents(NamedTuple):
    """The documents of a packed step, on the compute device."""

    positions: torch.Tensor  # (B, T) int64: each token's position in its document (RoPE)
    key_start: torch.Tensor  # (B, T) int32: absolute position of its document's first token
    doc_end: torch.Tensor  # (B, T) int32: one past its document's last token

    @property
    def lengths(self) -> torch.Tensor:
        """(B, T) int32: the length of each token's document."""
        return self.doc_end - self.key_start


def check_positions(position_ids, shape: tuple[int, ...]) -> torch.Tensor:
    """position_ids as an int64 tensor of `shape` (B, T) on its own device, checked: every row
    starts a document at 0, and within a document positions grow by 1 (a new document: 0)."""
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor of positions, got {type(position_ids).__name__}")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must hold integer positions, got dtype {position_ids.dtype}")
    if tuple(position_ids.shape) != tuple(shape):
        raise ValueError(f"position_ids shape {tuple(position_ids.shape)} does not match input_ids shape "
                         f"{tuple(shape)}; give each token its position in its document (0 where a document starts)")
    pos = position_ids.long()
    first = pos[:, 0]
    bad = (first != 0).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"position_ids[{b}, 0] = {int(first[b])}: a sequence must start a document (position 0); "
                         "a document cut at the start of a sequence restarts at 0")
    step = pos[:, 1:] - pos[:, :-1]
    wrong = ((step != 1) & (pos[:, 1:] != 0)).nonzero()
    if wrong.numel():
        b, t = (int(x) for x in wrong[0])
        raise ValueError(f"position_ids[{b}, {t + 1}] = {int(pos[b, t + 1])} after {int(pos[b, t])}: within a "
                         "document positions grow by 1, and a new document starts at 0 "
                         "(DataCollatorWithFlattening's convention)")
    return pos


def documents(position_ids: torch.Tensor) -> Documents:
    """Documents of checked position_ids (B, T) (check_positions), on their device."""
    b, t = position_ids.shape
    index = torch.arange(t, device=position_ids.device)
    key_start = (index - position_ids).to(torch.int32)  # (B, T)
    # doc_end[t]: the first document start after t (T when none): a reversed running minimum.
    starts = torch.where(position_ids == 0, index, t)
    later = torch.cat([starts[:, 1:], starts.new_full((b, 1), t)], dim=1)
    doc_end = later.flip(1).cummin(1).values.flip(1).to(torch.int32)
    return Documents(position_ids, key_start, doc_end)
