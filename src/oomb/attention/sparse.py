"""Page-level top-k sparse attention for models trained with dense attention.

Each page keeps a representative per KV head, written with the page: the mean of its post-RoPE
keys (MoBA), or their element-wise min and max (Quest's bound). Each block of `block_queries`
queries of a chunk scores the earlier pages with the mean of its query vectors against the
representatives (the maximum over the query heads of the KV head's group) and keeps `budget`
pages: the first `sink_pages` always, the best-scoring others after them. The blocks of one
chunk choose among the chunk's `chunk_budget` best pages (best for any of its blocks and
heads): that union is all a chunk reads of a layer, so offload moves only these pages, a
bounded number per layer and chunk. The chunk itself is always attended (causally). Selection
happens in stage 1 and is kept for stage 2, so forward and backward see the same pattern and
gradients are exact for it; with budget >= the number of earlier pages the result is dense
attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# A chunk's selection is data the page store holds (memory/spec.py).
from ..memory.spec import Selection, index_dtype
from ..units import parse_layers
from .policy import register_policy

REPRESENTATIVES = ("mean", "minmax")


@dataclass(frozen=True)
class TopKPages:
    """Page-level top-k (module docstring): a SparsePolicy (attention/policy.py)."""

    budget: int = 64  # pages attended per query block and KV head, sinks included (64 = 8K tokens)
    sink_pages: int = 1  # the first pages, always attended (attention sinks)
    representative: str = "mean"  # 'mean' (MoBA) or 'minmax' (Quest)
    block_queries: int = 128  # queries that share one selection
    # pages one chunk's blocks choose from (and offload moves), >= budget; None: max(256, budget)
    chunk_budget: int | None = None
    # Layers that attend densely among the top-k ones (negative: from the last layer, -1 the last).
    # Sparse training is known to hurt when only the last tokens carry loss (fine-tuning on long
    # prompts); a few dense last layers are the published fix.
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.chunk_budget is None and isinstance(self.budget, int):  # frozen: set through object
            object.__setattr__(self, "chunk_budget", max(256, self.budget))
        for name in ("budget", "block_queries", "chunk_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TopKPages({name}={value!r}) must be a positive int")
        if not 0 <= self.sink_pages <= self.budget:
            raise ValueError(f"TopKPages(sink_pages={self.sink_pages}) must be between 0 and budget={self.budget}")
        if self.chunk_budget < self.budget:
            raise ValueError(f"TopKPages(chunk_budget={self.chunk_budget}) must be >= budget={self.budget} "
                             "(the pages a chunk's blocks choose from)")
        if self.representative not in REPRESENTATIVES:
            raise ValueError(f"TopKPages(representative={self.representative!r}) must be one of {REPRESENTATIVES}")
        if not isinstance(self.dense_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.dense_layers):
            raise ValueError(f"TopKPages(dense_layers={self.dense_layers!r}) must be a tuple of layer indices, "
                             "e.g. (-2, -1) for the last two layers")

    def dense_set(self, n_layers: int) -> frozenset[int]:
        """The layers (0 .. n_layers - 1) that attend densely, negative indices resolved."""
        bad = [i for i in self.dense_layers if not -n_layers <= i < n_layers]
        if bad:
            raise ValueError(f"TopKPages(dense_layers={self.dense_layers}): layer {bad[0]} does not exist in a model "
                             f"of {n_layers} layers (valid: {-n_layers} .. {n_layers - 1})")
        return frozenset(i % n_layers for i in self.dense_layers)

    @property
    def rep_size(self) -> int:
        """Vectors per page and KV head in the representative."""
        return 2 if self.representative == "minmax" else 1

    def representatives(self, k: torch.Tensor, n_pages: int) -> torch.Tensor:
        return page_representatives(k, n_pages, self.representative)

    def select(self, q: torch.Tensor, reps: torch.Tensor, first_page: int = 0,
               block_pages: torch.Tensor | None = None) -> Selection:
        return select_pages(q, reps, self, first_page, block_pages)

    def describe(self) -> dict:
        return {"budget": self.budget, "representative": self.representative, "sink_pages": self.sink_pages}


def topk_from_settings(settings) -> TopKPages:
    """TopKPages from a run's sparse_* settings (`--sparse-policy topk`, the default): a chunk
    budget of 0 is TopKPages' default, max(256, budget); one below the budget is raised to it
    (TrainConfig refuses one before this)."""
    chunk_budget = max(settings.sparse_chunk_budget, settings.sparse_budget) if settings.sparse_chunk_budget else None
    return TopKPages(budget=settings.sparse_budget, chunk_budget=chunk_budget, sink_pages=settings.sparse_sink_pages,
                     representative=settings.sparse_representative,
                     dense_layers=parse_layers(settings.sparse_dense_layers))


register_policy("topk", topk_from_settings)


def page_representatives(k: torch.Tensor, n_pages: int, kind: str) -> torch.Tensor:
    """k: (B, Hkv, n*P, D) post-RoPE keys of whole pages -> (B, n, Hkv, R, D) in k's dtype."""
    b, h, t, d = k.shape
    pages = k.reshape(b, h, n_pages, t // n_pages, d).transpose(1, 2)  # (B, n, Hkv, P, D)
    if kind == "mean":
        return pages.float().mean(dim=3, keepdim=True).to(k.dtype)
    return torch.stack([pages.amin(dim=3), pages.amax(dim=3)], dim=3)


def select_pages(q: torch.Tensor, reps: torch.Tensor, cfg: TopKPages, first_page: int = 0,
                 block_pages: torch.Tensor | None = None) -> Selection:
    """The chunk's `min(chunk_budget, n)` best pages and each query block's `min(budget, n)`
    picks among them.

    q: (B, H, C, D) the chunk's post-RoPE queries; reps: (B, n, Hkv, R, D) of the n earlier pages.
    Packed documents: only pages from `first_page` on are candidates (those before hold documents
    no query of the chunk sees), and block_pages (B, n_blocks) int64, the page of each query
    block's first document start, bounds each block's picks: a page before it scores -inf (it is
    picked only where the block's documents have fewer pages than its budget, and then masked),
    and the sinks are the first `sink_pages` pages of that document.
    """
    reps = reps[:, first_page:]
    selection = _select(q, reps, cfg, block_pages - first_page if block_pages is not None else None)
    if first_page:
        selection = selection._replace(pages=selection.pages + first_page)
    return selection


def _select(q: torch.Tensor, reps: torch.Tensor, cfg: TopKPages, block_pages: torch.Tensor | None) -> Selection:
    """select_pages of the candidates reps (B, n, Hkv, R, D), pages relative to the first."""
    b, h, c, d = q.shape
    n, n_kv = reps.shape[1], reps.shape[2]
    blocks = -(-c // cfg.block_queries)
    keep, n_cand = min(cfg.budget, n), min(cfg.chunk_budget, n)
    if keep == 0:
        return Selection(torch.empty((b, 0), dtype=torch.int32, device=q.device),
                         torch.empty((b, n_kv, blocks, 0), dtype=index_dtype(0), device=q.device))
    # Mean query of each block and head: (B, Hkv, G, n_blocks, D), fp32.
    pad = blocks * cfg.block_queries - c
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, pad))
    counts = torch.full((blocks,), cfg.block_queries, device=q.device, dtype=torch.float32)
    counts[-1] -= pad
    qm = qf.view(b, n_kv, h // n_kv, blocks, cfg.block_queries, d).sum(4) / counts[:, None]
    r = reps.float().permute(0, 2, 3, 1, 4)  # (B, Hkv, R, n, D)
    if cfg.representative == "mean":
        scores = torch.einsum("bkgqd,bknd->bkgqn", qm, r[:, :, 0])
    else:  # Quest's upper bound of q.k over the page: sum_d max(q_d min_d, q_d max_d)
        scores = (torch.einsum("bkgqd,bknd->bkgqn", qm.clamp(min=0), r[:, :, 1])
                  + torch.einsum("bkgqd,bknd->bkgqn", qm.clamp(max=0), r[:, :, 0]))
    scores = scores.amax(dim=2)  # (B, Hkv, n_blocks, n): the best head of the group decides
    if block_pages is None:
        scores[..., : cfg.sink_pages] = float("inf")  # sinks are always kept
    else:  # per block: its documents' first pages are the sinks, the pages before them are not seen
        rel = torch.arange(n, device=q.device) - block_pages[:, None, :, None]  # (B, 1, n_blocks, n)
        scores = scores.masked_fill(rel < cfg.sink_pages, float("inf")).masked_fill(rel < 0, float("-inf"))
    if n_cand < n:  # the chunk's candidates: the pages best for any of its blocks and heads
        cand = torch.topk(scores.amax(dim=(1, 2)), n_cand, dim=-1, sorted=False).indices.sort(dim=-1).values
        scores = scores.gather(3, cand[:, None, None, :].expand(b, n_kv, blocks, n_cand))
    else:
        cand = torch.arange(n, device=q.device).expand(b, n)
    top = torch.topk(scores, keep, dim=-1, sorted=False).indices
    return Selection(cand.to(torch.int32).contiguous(), top.sort(dim=-1).values.to(index_dtype(n_cand)))


def selection_mask(pages, n_queries: int) -> torch.Tensor:
    """(B, Hkv, C, n_pages * P) bool: which of a group's keys each query may see."""
    sel = pages.selection.long() - pages.first_page  # (B, Hkv, n_blocks, k), relative to the group
    b, n_kv, blocks, _ = sel.shape
    n = pages.n_pages
    inside = (sel >= 0) & (sel < n)
    mask = torch.zeros((b, n_kv, blocks, n + 1), dtype=torch.bool, device=sel.device)
    mask.scatter_(3, torch.where(inside, sel, n), True)  # out-of-group picks land in the spare column
    mask = mask[..., :n].repeat_interleave(pages.block_queries, dim=2)[:, :, :n_queries]  # (B, Hkv, C, n)
    page_size = pages.k.shape[2]
    return mask.repeat_interleave(page_size, dim=3)  # (B, Hkv, C, n*P)
