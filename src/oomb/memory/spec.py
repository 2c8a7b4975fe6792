"""The frozen shape of one page (what it holds, how many bytes it takes) and of a model's K/V
memory (its layers' kinds, what each stores), the views attention reads of a layer's pages, and a
chunk's sparse-attention selection."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from ..models import adapter_class
from ..models.base import head_dim_of

if TYPE_CHECKING:
    from ..config import EngineConfig


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


@dataclass(frozen=True)
class KVShape:
    """What a model's K/V memory is made of under one EngineConfig, layer by layer, built once
    (from_adapter for the engine, from_config for `oomb plan`) and read by all that size it: the
    engine, its page store (memory/store.py), host offload (memory/offload.py), the step's memory
    (memory/step.py: placement's input, the room, the checks) and the plan (plan.py), so that the
    plan counts the bytes the engine allocates.

    A layer is of one of two kinds. Full attention: every page of a stored chunk is kept, with the
    sparse representatives, on the device or the host. Sliding window (`windows[i]` tokens): only
    each chunk's last `tail_pages[i]` pages, which a later query's window can reach, always on the
    device. (Attention-sink logits, GPT-OSS's, are parameters: they take no page memory.) Heads are
    this rank's under tensor parallelism.
    """

    page: PageSpec
    windows: tuple[int, ...]  # per layer: its sliding window in tokens, 0 for full attention
    chunk_pages: int  # pages per chunk (EngineConfig.pages_per_chunk)
    query_heads: int  # attention heads (the kept attention outputs are theirs)
    rep_size: int = 0  # sparse: representative vectors per page and KV head (0: dense, or a policy without)
    # pages a host layer stages at a time: with sparse attention a selection's worth (chunk_budget;
    # its dense layers, SparsePolicy.dense_set, too), else group_pages (sliding-window layers never
    # go to the host)
    staged_pages: int = 1024

    @classmethod
    def from_adapter(cls, adapter, engine: EngineConfig, dtype: torch.dtype) -> KVShape:
        """The shape of an adapted model (models/): its layers' windows, the KV heads this process
        computes (read off its weights: all of them, or its tensor-parallel share)."""
        kv_heads = adapter.local_kv_heads
        windows = tuple(adapter.window(i) for i in range(adapter.n_layers))
        return cls._build(engine, dtype, windows, kv_heads, kv_heads * (adapter.n_heads // adapter.n_kv_heads),
                          adapter.head_dim)

    @classmethod
    def from_config(cls, config, engine: EngineConfig, dtype: torch.dtype, tp: int = 1) -> KVShape:
        """The shape of the model a transformers `config` describes (no model needed), on one rank
        of tensor-parallel degree `tp` (1/tp of its heads)."""
        family = adapter_class(config)
        windows = tuple(family.layer_window(config, i) for i in range(config.num_hidden_layers))
        return cls._build(engine, dtype, windows, config.num_key_value_heads // tp, config.num_attention_heads // tp,
                          head_dim_of(config))

    @classmethod
    def _build(cls, engine: EngineConfig, dtype: torch.dtype, windows: tuple[int, ...], kv_heads: int,
               query_heads: int, head_dim: int) -> KVShape:
        """The shape under `engine` of a model of these layers and this rank's heads."""
        sparse = engine.sparse
        return cls(PageSpec(engine.page_size, kv_heads, head_dim, dtype, engine.kv_grad_dtype), windows,
                   engine.pages_per_chunk, query_heads, rep_size=sparse.rep_size if sparse is not None else 0,
                   staged_pages=sparse.chunk_budget if sparse is not None else engine.group_pages)

    @property
    def n_layers(self) -> int:
        return len(self.windows)

    @property
    def chunk_size(self) -> int:
        """Tokens per chunk."""
        return self.chunk_pages * self.page.page_size

    @cached_property
    def tail_pages(self) -> dict[int, int]:
        """Sliding-window layer -> pages of each chunk it keeps: the last ones a later query's
        window can reach."""
        page_size = self.page.page_size
        return {i: min(self.chunk_pages, -(-(w - 1) // page_size)) for i, w in enumerate(self.windows) if w}

    @cached_property
    def full_layers(self) -> tuple[int, ...]:
        """The full-attention layers: those whose pages may go to the host, and that keep sparse
        representatives."""
        return tuple(i for i, w in enumerate(self.windows) if not w)

    def kept_pages(self, layer: int, n_pages: int) -> int:
        """Pages of a chunk of `n_pages` that `layer` stores."""
        return min(n_pages, self.tail_pages.get(layer, n_pages))

    @property
    def rep_bytes(self) -> int:
        """Bytes of one page's sparse representatives (all KV heads)."""
        p = self.page
        return self.rep_size * p.n_kv_heads * p.head_dim * _itemsize(p.dtype)

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page of a full-attention layer: K, V, dK, dV and the sparse representatives."""
        return self.page.page_bytes + self.rep_bytes

    def window_bytes(self, batch: int, stored_chunks: int) -> int:
        """Bytes of the sliding-window layers' pages for `stored_chunks` chunks of `batch` sequences."""
        return stored_chunks * batch * sum(self.tail_pages.values()) * self.page.page_bytes

    def staged_slots(self, max_pages: int) -> int:
        """Pages a host layer's GPU staging buffer holds (memory/offload.py): a group (dense) or a
        selection (sparse), or all of a layer's `max_pages` pages when fewer; at least one."""
        return max(1, min(self.staged_pages, max_pages))

    def staging_bytes(self, batch: int, max_pages: int) -> int:
        """Device bytes a step with host layers stages their pages in: two buffers of
        `staged_slots` pages per sequence and one layer's representatives."""
        return 2 * self.staged_slots(max_pages) * batch * self.page.page_bytes + batch * max_pages * self.rep_bytes

    def kept_attention_bytes(self, stored_chunks: int, kept_layers: int, batch: int) -> int:
        """What keep_attention holds on the device for `kept_layers` layers (at most every layer
        but the last: stage 1 stops at its K/V): each stored chunk's attention output (B, H, C, D)
        in the model's dtype and its fp32 LSE. (Pinned host entries are aligned: memory/kept.py.)"""
        p = self.page
        return stored_chunks * kept_layers * batch * self.chunk_size * self.query_heads * (
            p.head_dim * _itemsize(p.dtype) + 4)


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
