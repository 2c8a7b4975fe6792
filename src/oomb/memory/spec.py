"""The frozen shape of one page (what it holds, how many bytes it takes), the views attention
reads of a layer's pages, and a chunk's sparse-attention selection."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from typing import NamedTuple, Protocol

import torch


@dataclass(frozen=True)
class PageSpec:
    """P tokens of one layer's keys and values, and their gradient accumulators.

    K and V of a page are each `[n_kv_heads, page_size, head_dim]` in `dtype` (the model's);
    dK and dV are the same shape in `grad_dtype` (fp32 by default: they sum the contributions
    of every later chunk, so they are accumulators, not activations), or absent when
    `grad_dtype` is None (evaluation: no backward reads them).
    """

    page_size: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    grad_dtype: torch.dtype | None = torch.float32

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(
                f"page_size={self.page_size} must be a power of two (kernel tiles split pages evenly); "
                "use 64, 128 or 256"
            )

    @property
    def elements(self) -> int:
        """Elements of one of K, V, dK, dV in a page."""
        return self.n_kv_heads * self.page_size * self.head_dim

    @property
    def kv_bytes(self) -> int:
        """K and V of one page."""
        return 2 * self.elements * _itemsize(self.dtype)

    @property
    def grads(self) -> bool:
        """Whether pages carry dK/dV accumulators."""
        return self.grad_dtype is not None

    @property
    def grad_bytes(self) -> int:
        """dK and dV accumulators of one page."""
        return 2 * self.elements * _itemsize(self.grad_dtype) if self.grads else 0

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes + self.grad_bytes


def window_tail_pages(window: int, page_size: int, pages_per_chunk: int) -> int:
    """Pages of each chunk a sliding-window layer keeps: the last ones a later query's window of
    `window` tokens can reach (the engine's store and the memory plan both count these)."""
    return min(pages_per_chunk, -(-(window - 1) // page_size))


def staged_slots(group_pages: int, max_pages: int) -> int:
    """Pages a host layer's GPU staging buffer holds (memory/offload.py): a group (dense) or a
    selection (sparse), or all of a layer's `max_pages` pages when fewer; at least one."""
    return max(1, min(group_pages, max_pages))


def staging_bytes(staged_pages: int, max_pages: int, batch: int, page_bytes: int, rep_bytes: int = 0) -> int:
    """Device bytes a step with host layers stages their pages in: two buffers of `staged_slots`
    pages per sequence (a group, or a sparse selection; offload.py) and one layer's representatives."""
    return 2 * staged_slots(staged_pages, max_pages) * batch * page_bytes + batch * max_pages * rep_bytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class LayerPages(NamedTuple):
    """What attention needs of one layer's earlier pages (all views, no copies)."""

    k: torch.Tensor  # (n_slots, Hkv, P, D)
    v: torch.Tensor  # (n_slots, Hkv, P, D)
    dk: torch.Tensor | None  # (n_slots, Hkv, P, D) fp32, or None when no gradient is wanted
    dv: torch.Tensor | None
    table: torch.Tensor  # (B, n_pages) int32: slots of the earlier pages, in position order
    first_page: int = 0  # logical index of table[:, 0] (groups after the first start later)
    # Sparse attention (attention/sparse.py): logical pages each block of `block_queries`
    # queries attends, (B, Hkv, n_blocks, budget) int32, or None for dense.
    selection: torch.Tensor | None = None
    block_queries: int = 0
    # Sliding-window layers (GPT-OSS): key j is visible to query i iff pos(j) > pos(i) - window.
    # 0: full attention. Page p holds positions p*P .. p*P+P-1; the chunk starts at q_start.
    window: int = 0
    q_start: int = 0
    # Packed documents (attention/documents.py): per token of the sequence, (B, T) int32, the
    # absolute position of its document's first token and one past its last; query i (at
    # q_start + i) sees key j iff key_start[q_start + i] <= j. None: one document per sequence.
    key_start: torch.Tensor | None = None
    doc_end: torch.Tensor | None = None
    # (B, n_pages) int32: the logical page of each table column when they are not contiguous from
    # first_page (a gathered sparse group, whose columns are the chunk's candidates); packing only.
    logical: torch.Tensor | None = None

    @property
    def n_pages(self) -> int:
        return self.table.shape[1]


class ScheduledGroups(Protocol):
    """A layer's earlier pages as the engine reads them (memory/store.py's page_groups and
    selected_groups): attention/function.py's PageGroups, and the transfers started early."""

    def __call__(self, with_grad: bool) -> Iterator[LayerPages]:
        """Yield the groups on the compute device (with dK/dV `with_grad`, written back after each)."""

    def prefetch(self, with_grad: bool) -> None:
        """Start moving the first group to the device now (nothing to do for pages already there)."""

    def then(self, with_grad: bool, groups: "ScheduledGroups") -> None:
        """Start `groups`' first group (the next layer this pass reads) as soon as this layer's
        groups leave a staging buffer free."""


class Selection(NamedTuple):
    """What one chunk attends of one layer's earlier pages (kept from stage 1 for stage 2)."""

    pages: torch.Tensor  # (B, n_cand) int32 ascending: the logical pages the chunk reads
    blocks: torch.Tensor  # (B, Hkv, n_blocks, k) ascending: each block's picks, as indices into pages (uint8
    # up to 256 candidates, else int16/int32)
    host_pages: tuple | None = None  # a host layer's: (pinned copy of pages, its copy's event), memory/offload.py

    def logical(self) -> torch.Tensor:
        """(B, Hkv, n_blocks, k) logical page of every pick."""
        b, n_kv, blocks, k = self.blocks.shape
        flat = self.pages.long()[:, None, :].expand(b, n_kv * blocks, -1)
        return flat.gather(2, self.blocks.long().view(b, n_kv * blocks, k)).view(b, n_kv, blocks, k).int()


def index_dtype(n_cand: int) -> torch.dtype:
    """Selection.blocks' dtype for n_cand candidates: the smallest that indexes them (selections are
    kept for the whole step, every chunk and layer; the memory plan counts them in it)."""
    return torch.uint8 if n_cand <= 256 else torch.int16 if n_cand <= 2**15 else torch.int32
