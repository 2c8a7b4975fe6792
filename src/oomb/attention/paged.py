"""Paged attention in Triton: a chunk's queries over the earlier pages plus its own keys.

Query i of a chunk of C tokens sees every key of the n_pages earlier pages (all full, all
before the chunk) and the chunk's own keys j <= i. The kernels read the pages in place through
the page table (no gather) and add the gradient of the earlier keys/values into the fp32
gradient pages. The semantics are reference.py's, which the tests compare against.

The kernels live in paged_forward.py (the forward and the tile helpers) and paged_backward.py;
this file holds their launch settings, the launchers and the backend interface.

Grids (no atomics: every output element has exactly one writer, so gradients are bitwise
deterministic run to run):
  forward       (query tile, b * H)     loop: page key tiles, then own keys (causal)
  preprocess    (query tile, b * H)     delta = rowsum(O * dO)
  dK/dV pages   (page key tile, b*Hkv)  loop: the query tiles of the G heads of the group;
                                         read-modify-write into pages.dk / pages.dv (fp32)
  dK/dV own     (b * H, key tile)       loop: the query tiles at or after the key tile (causal)
                                         of one query head; its share, summed per group after
  dQ            (query tile, b * H)     loop: page key tiles, then own keys (causal)
On Hopper GPUs, dense pages with gradients take paged_hopper.py's fused kernel (Gluon) instead
of the dK/dV pages kernel and the dQ kernel's page loop:
  dK/dV + dQ    (page key tile, b*Hkv)  loop: as dK/dV pages (one writer per dK/dV element); each
                                         query tile's dQ share added into an int32 dQ by TMA
                                         reductions, as fixed point: integer sums do not depend on
                                         their order, so dQ too is the same bits run to run

Tricks, stated where they happen: exp2 with 1/ln 2 folded into the softmax scale; only the
(base-2) LSE is saved for backward; the causal loops are split so the mask is applied on the
diagonal tiles only; the key tile size is independent of the page size (a page is stepped
through in PAGE_SIZE // BLOCK_N tiles).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..memory.spec import LayerPages
from . import paged_hopper
from .options import KernelOptions
from .paged_backward import (_paged_attn_bwd_dkdv_own, _paged_attn_bwd_dkdv_pages, _paged_attn_bwd_dq,
                             _paged_attn_bwd_preprocess)
from .paged_forward import _paged_attn_fwd

LN2 = math.log(2.0)
RCP_LN2 = 1.0 / LN2
MAX_HEAD_DIM = 256
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the dK/dV pages
# The forward and dQ kernels load page tiles through tensor descriptors where they can (_descriptors):
# on the H200 +10 % forward TFLOP/s, and a dQ kernel 26 % faster, its loop pipelined; the dK/dV pages
# kernel its query tiles (Q, dO): 2-4 % faster (H200, 2026-11-30, e32e5de..ac5ede3; docs/experiments.md).
# KernelOptions(tma=False) turns all off, dq_tma=False the dQ kernel's (pointer loads, its page slots
# in the loop), dkdv_tma=False the dK/dV kernel's.
DEFAULT_KERNELS = KernelOptions()
# Pages whose pool slots a forward program loads at once, into registers, before looping over
# their key tiles (_slot_batch).
SLOT_BATCH = 64


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: LayerPages) -> None:
    """Errors a caller can cause, with the value, the limit and the fix."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, C, D) / (B, Hkv, C, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    if k.shape != (b, n_kv, c, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be (B, Hkv, C, D) = ({b}, Hkv, {c}, {d}); got {tuple(k.shape)}, {tuple(v.shape)}")
    if n_kv == 0 or h % n_kv != 0:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={n_kv}")
    if c < 1:
        raise ValueError(f"the chunk must have at least 1 query; got C={c}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim={d} is larger than the Triton kernels support ({MAX_HEAD_DIM}); "
                         "use backend='torch' for this model")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    if k.dtype != q.dtype or v.dtype != q.dtype or pages.k.dtype != q.dtype or pages.v.dtype != q.dtype:
        raise ValueError(f"q, k, v and the pages must share one dtype; got q {q.dtype}, k {k.dtype}, "
                         f"v {v.dtype}, pages {pages.k.dtype}/{pages.v.dtype}")
    n_slots, p_kv, page_size, p_d = pages.k.shape
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two >= 16 for the Triton kernels")
    if (p_kv, p_d) != (n_kv, d) or pages.v.shape != pages.k.shape:
        raise ValueError(f"page pools must be (n_slots, Hkv={n_kv}, P, D={d}); got {tuple(pages.k.shape)}, "
                         f"{tuple(pages.v.shape)}")
    if pages.table.dim() != 2 or pages.table.shape[0] != b:
        raise ValueError(f"pages.table must be (B={b}, n_pages); got {tuple(pages.table.shape)}")
    if pages.dk is not None:
        if pages.dk.shape != pages.k.shape or pages.dv is None or pages.dv.shape != pages.k.shape:
            raise ValueError("pages.dk and pages.dv must both be given, shaped like pages.k")
        if pages.dk.dtype not in GRAD_DTYPES or pages.dv.dtype != pages.dk.dtype:
            raise ValueError(f"gradient pages must share one dtype of {GRAD_DTYPES} (the kernels add in fp32 and "
                             f"round once into them); got {pages.dk.dtype}/{pages.dv.dtype}")
    if pages.key_start is not None:
        need = (b, pages.q_start + c)
        for name, x in (("key_start", pages.key_start), ("doc_end", pages.doc_end)):
            if x is None or x.dtype != torch.int32 or x.dim() != 2 or x.shape[0] != b or x.shape[1] < need[1]:
                raise ValueError(f"pages.{name} must be int32 (B={b}, T >= q_start + C = {need[1]}) "
                                 f"(attention/documents.py); got {None if x is None else (x.dtype, tuple(x.shape))}")
    # Internal layout invariants of the store (pools made with empty_like share strides).
    assert pages.k.stride() == pages.v.stride(), "k and v pools must share strides"
    assert pages.dk is None or pages.dk.stride() == pages.dv.stride(), "dk and dv pools must share strides"


def _check_backward(do: torch.Tensor, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """The backward's own inputs: dO and O like q, the LSE (B, H, C) fp32."""
    if do.shape != q.shape or o.shape != q.shape:
        raise ValueError(f"do and o must be shaped like q {tuple(q.shape)}; got {tuple(do.shape)}, {tuple(o.shape)}")
    if do.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"do dtype {do.dtype} is not supported; use float16, bfloat16 or float32")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 {tuple(q.shape[:3])}; got {lse.dtype} {tuple(lse.shape)}")


def _head_dim_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


@dataclass(frozen=True)
class FwdTiles:
    """The forward's launch: BLOCK_M queries held, BLOCK_N keys streamed, warps, pipeline stages."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class BwdTiles:
    """The backward's launches. dK/dV kernels: BLOCK_N1 keys held, BLOCK_M1 queries streamed
    (BLOCK_N1 % BLOCK_M1 == 0), warps1 warps, stages1 pipeline stages; dQ: BLOCK_M2 queries held,
    BLOCK_N2 keys streamed (BLOCK_M2 % BLOCK_N2 == 0), warps2, stages2."""

    BLOCK_M1: int
    BLOCK_N1: int
    warps1: int
    stages1: int
    BLOCK_M2: int
    BLOCK_N2: int
    warps2: int
    stages2: int


def _fwd_config(q: torch.Tensor, head_dim: int) -> FwdTiles:
    """Tile sizes: small ones for the interpreter; H100/H200 ones for D <= 128 in 16-bit."""
    if q.device.type != "cuda":
        return FwdTiles(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32 or head_dim > 128:  # twice the bytes per tile: halve it
        return FwdTiles(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    # bench/tune_attention.py on an H200 (bf16, D=128, C=4096, 2026-11-30; its rows:
    # git show 45629ca:bench/results/tune.jsonl),
    # page slots from registers (_slot_batch): 3 stages 549.9 TFLOP/s at 64K keys dense, 490.5 at
    # top-k 64 of 1M; 2 stages 442.6 / 437.8 (with slots loaded in the loop, 2 stages had been the
    # faster: 461.1 vs 448.5 dense). 4 stages are out of shared memory; 64-key tiles slower.
    return FwdTiles(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def _bwd_config(q: torch.Tensor, head_dim: int) -> BwdTiles:
    """BwdTiles: small ones for the interpreter; H100/H200 ones for D <= 128 in 16-bit."""
    if q.device.type != "cuda":
        return BwdTiles(BLOCK_M1=16, BLOCK_N1=32, warps1=4, stages1=1, BLOCK_M2=32, BLOCK_N2=16, warps2=4, stages2=1)
    if q.dtype == torch.float32 or head_dim > 128:
        return BwdTiles(BLOCK_M1=16, BLOCK_N1=64, warps1=4, stages1=1, BLOCK_M2=64, BLOCK_N2=16, warps2=4, stages2=1)
    # bench/tune_attention.py on an H200 (as _fwd_config): 362.9 TFLOP/s (2.5x fwd FLOPs); 64x64
    # tiles with 4 warps and 2 stages 373.0 in the sweep but slower in the step; 32-query tiles
    # 324.7 or less. With dQ's descriptor loop (dq_tma): 400.5 for these dQ settings, 401.5 with
    # 4 stages, 392.8 with 128-key tiles and 2 stages (3 and 4 do not fit shared memory).
    return BwdTiles(BLOCK_M1=64, BLOCK_N1=128, warps1=8, stages1=3, BLOCK_M2=128, BLOCK_N2=64, warps2=8, stages2=3)


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs: exact fp32 dots (the GPU would otherwise use TF32); 16-bit inputs ignore it.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _group_picks(pages: LayerPages) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection relative to the group's first page (B, Hkv, n_blocks, k) int64, and which
    picks fall inside the group."""
    sel = pages.selection.long() - pages.first_page
    return sel, (sel >= 0) & (sel < pages.n_pages)


def _sparse_args(pages: LayerPages, c: int) -> dict:
    """Kernel arguments of a group's sparse selection (dummies when dense).

    Sel (B, Hkv, n_blocks, k) int32: the selected pages relative to the group, ascending;
    Span (B, Hkv, n_blocks, 2) int32: the entries [lo, hi) of each row inside the group.
    """
    device = pages.table.device
    if pages.selection is None:
        dummy = torch.zeros(2, dtype=torch.int32, device=device)
        return dict(Sel=dummy, Span=dummy, n_blocks=1, max_sel=1, block_q=max(c, 1), SPARSE=False)
    if pages.window:
        raise ValueError("sparse selection on a sliding-window layer: its window already bounds the pages")
    sel, inside = _group_picks(pages)
    b, n_kv, n_blocks, k = sel.shape
    n = pages.n_pages
    span = torch.stack([(sel < 0).sum(-1), (sel < n).sum(-1)], dim=-1).to(torch.int32)
    rel = torch.where(inside, sel, 0).to(torch.int32)
    if k == 0:
        rel = torch.zeros((b, n_kv, n_blocks, 1), dtype=torch.int32, device=device)
    return dict(Sel=rel.contiguous(), Span=span.contiguous(), n_blocks=n_blocks, max_sel=rel.shape[-1],
                block_q=pages.block_queries, SPARSE=True)


def _document_args(pages: LayerPages) -> dict:
    """Kernel arguments of packed documents (dummies without): KeyStart and DocEnd (B, T) int32
    (contiguous, one row stride), q_start, and for a sparse group PagePos (B, n_pages) int32, the
    first key of each table column's page relative to the chunk's start."""
    device = pages.table.device
    dummy = torch.zeros(2, dtype=torch.int32, device=device)
    if pages.key_start is None:
        return dict(KeyStart=dummy, DocEnd=dummy, PagePos=dummy, stride_ksb=0, stride_ppb=0, q_start=0, PACKED=False)
    key_start, doc_end = pages.key_start.contiguous(), pages.doc_end.contiguous()
    page_pos = dummy
    if pages.selection is not None:
        logical = pages.logical
        if logical is None:
            logical = torch.arange(pages.first_page, pages.first_page + pages.n_pages, device=device).expand(
                pages.table.shape[0], -1)
        page_pos = (logical.long() * pages.k.shape[2] - pages.q_start).to(torch.int32).contiguous()  # (B, n)
    return dict(KeyStart=key_start, DocEnd=doc_end, PagePos=page_pos, stride_ksb=key_start.stride(0),
                stride_ppb=page_pos.stride(0) if page_pos.dim() == 2 else 0, q_start=pages.q_start, PACKED=True)


def _page_visits(pages: LayerPages) -> dict:
    """The dK/dV kernel's view of a sparse selection: which query blocks chose each page.

    Visits (B, Hkv, n_pages, n_blocks) int32: a page's choosing blocks first, ascending;
    NVisits (B, Hkv, n_pages) int32: how many; Order (B, Hkv, n_pages) int32: the pages, most
    visited first (the longest programs start first).
    """
    device = pages.table.device
    if pages.selection is None:
        dummy = torch.zeros(2, dtype=torch.int32, device=device)
        return dict(Order=dummy, Visits=dummy, NVisits=dummy)
    sel, inside = _group_picks(pages)
    b, n_kv, n_blocks, _ = sel.shape
    n = pages.n_pages
    # chosen[b, h, page, block] = 1 for every pick; picks outside the group land in row n. A
    # scatter with a scalar: `chosen[index] = 1` would copy the 1 from the host and sync.
    row = torch.where(inside, sel, n) * n_blocks + torch.arange(n_blocks, device=device)[:, None]
    chosen = torch.zeros((b, n_kv, (n + 1) * n_blocks), dtype=torch.int8, device=device)
    chosen.scatter_(2, row.flatten(2), 1)
    chosen = chosen.view(b, n_kv, n + 1, n_blocks)[:, :, :n]
    count = chosen.sum(-1, dtype=torch.int32)
    visits = torch.sort(chosen, dim=-1, descending=True, stable=True).indices  # chosen blocks first, ascending
    order = torch.sort(count, dim=-1, descending=True, stable=True).indices
    return dict(Order=order.to(torch.int32).contiguous(), Visits=visits.to(torch.int32).contiguous(),
                NVisits=count.contiguous())


def _forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True, o_dtype=None, kernels=None):
    """o (B, H, C, D) in o_dtype (default q's) and the base-2 lse (B, H, C) fp32."""
    kernels = kernels or DEFAULT_KERNELS
    _check(q, k, v, pages)
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    page_size = pages.k.shape[2]
    cfg = _fwd_config(q, d)
    block_n = min(cfg.BLOCK_N, page_size)  # P % BLOCK_N == 0 (both powers of two)
    o = torch.empty((b, h, c, d), dtype=o_dtype or q.dtype, device=q.device)
    lse = torch.empty((b, h, c), dtype=torch.float32, device=q.device)
    sp = _sparse_args(pages, c)
    n_m = triton.cdiv(c, cfg.BLOCK_M)
    grid = (n_m * b * h,) if sp["SPARSE"] else (n_m, b * h)  # _fwd_program's launch orders
    _check_blocks(sp, cfg.BLOCK_M)
    kp, vp, tma = _descriptors((pages.k, pages.v), block_n, d, kernels.tma and pages.n_pages > 0)
    docs = _document_args(pages)
    _paged_attn_fwd[grid](
        q, k, v, kp, vp, pages.table, sp["Sel"], sp["Span"], docs["KeyStart"], docs["PagePos"], o, lse,
        *q.stride(), *k.stride(), *v.stride(), *pages.k.stride(), *pages.table.stride(), *o.stride(),
        docs["stride_ksb"], docs["stride_ppb"],
        c, pages.n_pages, scale * RCP_LN2, h, sp["n_blocks"], sp["max_sel"], sp["block_q"], *_window_args(pages),
        docs["q_start"],
        GROUP=h // n_kv, D=d, HEAD_DIM=_head_dim_block(d), PAGE_SIZE=page_size,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=block_n, IN_PRECISION=_precision(q), INCLUDE_SELF=include_self,
        SPARSE=sp["SPARSE"], WINDOWED=pages.window > 0, TMA=tma, SLOTS=SLOT_BATCH, PACKED=docs["PACKED"],
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o, lse


def _descriptors(tensors: tuple, block_rows: int, d: int, enabled: bool = True) -> tuple:
    """(*tensors, tma) as a kernel takes them: tensor descriptors of (1, 1, block_rows, d) blocks
    when `enabled` and _tma_eligible, else the tensors themselves."""
    if not (enabled and _tma_eligible(tensors, d)):
        return (*tensors, False)
    return (*(TensorDescriptor.from_tensor(x, [1, 1, block_rows, d]) for x in tensors), True)


def _tma_eligible(tensors: tuple, d: int) -> bool:
    """Whether a kernel may read these (B-or-slot, heads, rows, D) tensors through tensor
    descriptors (the TMA unit): a Hopper or later GPU (or the interpreter), 16-bit, a power-of-two
    head_dim, 16-byte aligned strides and data."""
    if d != _head_dim_block(d):
        return False
    device = tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    return all(x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1
               and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0
               for x in tensors)


def _window_args(pages: LayerPages) -> tuple[int, int]:
    """(window, position of the group's first key relative to the chunk's first query)."""
    return pages.window, pages.first_page * pages.k.shape[2] - pages.q_start


def _check_blocks(sp: dict, block_m: int) -> None:
    if sp["SPARSE"] and sp["block_q"] % block_m:
        raise ValueError(f"TopKPages(block_queries={sp['block_q']}) must be a multiple of the kernel's query "
                         f"tile {block_m} on this device; use block_queries=128 (or 256)")


def _backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True, dq_dtype=None,
              kernels=None):
    """dq (dq_dtype, default q's), dk, dv of the chunk (None without include_self); adds the
    pages' gradient into pages.dk/dv. lse is base 2, as _forward returns it."""
    kernels = kernels or DEFAULT_KERNELS
    _check(q, k, v, pages)
    _check_backward(do, q, o, lse)
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    group = h // n_kv
    page_size = pages.k.shape[2]
    head_dim = _head_dim_block(d)
    cfg = _bwd_config(q, d)
    launch1 = dict(num_warps=cfg.warps1, num_stages=cfg.stages1)  # the dK/dV kernels
    precision = _precision(q)

    delta = torch.empty_like(lse)  # (B, H, C) fp32
    _paged_attn_bwd_preprocess[(triton.cdiv(c, 64), b * h)](
        o, do, delta, *o.stride(), *do.stride(), c, h, D=d, HEAD_DIM=head_dim, BLOCK_M=64,
    )

    sp = _sparse_args(pages, c)
    docs = _document_args(pages)
    _check_blocks(sp, cfg.BLOCK_M1)
    _check_blocks(sp, cfg.BLOCK_M2)
    # On Hopper, dense pages with gradients: dK/dV and the pages' dQ in one Gluon kernel (five tile
    # products, not seven); the dQ kernel below then runs over the chunk's own keys only. Packed
    # documents take the Triton kernels (paged_hopper.eligible): the Gluon kernel has no document mask.
    dq_pages = None
    if kernels.gluon and paged_hopper.eligible(q, pages):
        dq_pages = paged_hopper.backward_pages(do, q, lse, delta, pages, scale)  # (B, H, C, D) fp32
    elif pages.dk is not None and pages.n_pages > 0:
        visits = _page_visits(pages)
        block_n = min(cfg.BLOCK_N1, page_size)  # no causal mask here: any BLOCK_M1 works
        grid = (pages.n_pages * (page_size // block_n) * b * n_kv,)
        q_in, do_in, tma = _descriptors((q, do), cfg.BLOCK_M1, d, kernels.tma and kernels.dkdv_tma)
        _paged_attn_bwd_dkdv_pages[grid](
            q_in, do_in, lse, delta, pages.k, pages.v, pages.dk, pages.dv, pages.table, visits["Order"],
            visits["Visits"], visits["NVisits"], docs["KeyStart"], docs["DocEnd"], docs["PagePos"],
            *q.stride(), *do.stride(), *pages.k.stride(), *pages.dk.stride(), *pages.table.stride(),
            docs["stride_ksb"], docs["stride_ppb"],
            c, scale * RCP_LN2, scale, h, n_kv, pages.n_pages, sp["n_blocks"] if sp["SPARSE"] else 1, sp["block_q"],
            *_window_args(pages), docs["q_start"],
            GROUP=group, D=d, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            BLOCK_M=cfg.BLOCK_M1, BLOCK_N=block_n, IN_PRECISION=precision, SPARSE=sp["SPARSE"],
            WINDOWED=pages.window > 0, MAX_BLOCKS=triton.next_power_of_2(sp["n_blocks"] if sp["SPARSE"] else 1),
            TMA=tma, PACKED=docs["PACKED"], **launch1,
        )

    dk = dv = None
    if include_self:
        # Each query head's share (fp32 when a group's shares are summed), then the group's sum.
        share = torch.float32 if group > 1 else k.dtype
        dk = torch.empty((b, h, c, d), dtype=share, device=k.device)
        dv = torch.empty((b, h, c, d), dtype=share, device=v.device)
        _paged_attn_bwd_dkdv_own[(b * h, triton.cdiv(c, cfg.BLOCK_N1))](
            q, do, lse, delta, k, v, dk, dv, docs["KeyStart"], docs["DocEnd"],
            *q.stride(), *do.stride(), *k.stride(), *v.stride(), *dk.stride(), docs["stride_ksb"],
            c, scale * RCP_LN2, scale, h, pages.window, docs["q_start"],
            GROUP=group, D=d, HEAD_DIM=head_dim,
            BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1, IN_PRECISION=precision, WINDOWED=pages.window > 0,
            PACKED=docs["PACKED"], **launch1,
        )
        if group > 1:
            dk = dk.view(b, n_kv, group, c, d).sum(2).to(k.dtype)
            dv = dv.view(b, n_kv, group, c, d).sum(2).to(v.dtype)

    n_pages = 0 if dq_pages is not None else pages.n_pages  # the pages' share is in dq_pages
    dq_dtype = dq_dtype or q.dtype
    if dq_pages is not None and not include_self:
        return dq_pages.to(dq_dtype), dk, dv
    # (B, H, C, D); fp32 when the pages' share is added after (one rounding to dq_dtype)
    dq = torch.empty(q.shape, dtype=dq_dtype if dq_pages is None else torch.float32, device=q.device)
    block_n = min(cfg.BLOCK_N2, page_size)
    kp, vp, tma = _descriptors((pages.k, pages.v), block_n, d, kernels.tma and kernels.dq_tma and n_pages > 0)
    _paged_attn_bwd_dq[(triton.cdiv(c, cfg.BLOCK_M2), b * h)](
        q, do, lse, delta, k, v, kp, vp, pages.table, sp["Sel"], sp["Span"], docs["KeyStart"], docs["PagePos"], dq,
        *q.stride(), *do.stride(), *k.stride(), *v.stride(), *pages.k.stride(), *pages.table.stride(),
        *dq.stride(), docs["stride_ksb"], docs["stride_ppb"],
        c, n_pages, scale * RCP_LN2, scale, h, sp["n_blocks"], sp["max_sel"], sp["block_q"],
        *_window_args(pages), docs["q_start"],
        GROUP=group, D=d, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=cfg.BLOCK_M2, BLOCK_N=block_n, IN_PRECISION=precision,
        INCLUDE_SELF=include_self, SPARSE=sp["SPARSE"], WINDOWED=pages.window > 0, TMA=tma, SLOTS=SLOT_BATCH,
        PACKED=docs["PACKED"],
        num_warps=cfg.warps2, num_stages=cfg.stages2,
    )
    if dq_pages is not None:
        dq = dq.add_(dq_pages).to(dq_dtype)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------
# The backend interface (attention/function.py runs it over groups of pages, with autograd)
# ----------------------------------------------------------------------------------------


def forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True, kernels=None):
    """One group's (o fp32 (B, H, C, D), lse fp32 (B, H, C), natural log); see reference.forward.
    kernels: an oomb.KernelOptions (None: every fast path on)."""
    o, lse2 = _forward(q, k, v, pages, scale, include_self, o_dtype=torch.float32, kernels=kernels)
    return o, lse2 * LN2  # log2-sum-exp2 -> natural log


def backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True, kernels=None):
    """One group's (dq fp32, dk, dv or None) given the final o, lse (natural log) of all groups;
    adds the pages' dK/dV into pages.dk / pages.dv. See reference.backward."""
    return _backward(do, q, k, v, o, lse * RCP_LN2, pages, scale, include_self, dq_dtype=torch.float32,
                     kernels=kernels)
