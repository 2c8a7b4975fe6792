"""Paged attention in Triton: a chunk's queries over the earlier pages plus its own keys.

Query i of a chunk of C tokens sees every key of the n_pages earlier pages (all full, all
before the chunk) and the chunk's own keys j <= i. The kernels read the pages in place through
the page table (no gather) and add the gradient of the earlier keys/values into the fp32
gradient pages. The semantics are reference.py's, which the tests compare against.

File order follows Triton's fused-attention tutorial: inner loop helper, forward kernel,
backward preprocess, backward kernels, autograd Function, public alias.

Grids (no atomics anywhere: every output element has exactly one writer, so gradients are
bitwise deterministic run to run):
  forward       (query tile, b * H)     loop: page key tiles, then own keys (causal)
  preprocess    (query tile, b * H)     delta = rowsum(O * dO)
  dK/dV pages   (page key tile, b*Hkv)  loop: the query tiles of the G heads of the group;
                                         read-modify-write into pages.dk / pages.dv (fp32)
  dK/dV own     (b * H, key tile)       loop: the query tiles at or after the key tile (causal)
                                         of one query head; its share, summed per group after
  dQ            (query tile, b * H)     loop: page key tiles, then own keys (causal)

Tricks, stated where they happen: exp2 with 1/ln 2 folded into the softmax scale; only the
(base-2) LSE is saved for backward; the causal loops are split so the mask is applied on the
diagonal tiles only; the key tile size is independent of the page size (a page is stepped
through in PAGE_SIZE // BLOCK_N tiles).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..memory.spec import LayerPages

LN2 = math.log(2.0)
RCP_LN2 = 1.0 / LN2
MAX_HEAD_DIM = 256
# The forward loads page tiles through tensor descriptors where it can (_tma_pools): +10 % forward
# TFLOP/s on the H200 (docs/benchmarks.md). OOMB_TMA=0 turns it off.
TMA = os.environ.get("OOMB_TMA", "1") != "0"
# Pages whose pool slots a forward program loads at once, into registers, before looping over
# their key tiles (_slot_batch).
SLOT_BATCH = 64


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------


@triton.jit
def _page_range(Span, row, n_pages, SPARSE: tl.constexpr):
    """Pages [p_lo, p_hi) a query block visits in this group: every page (dense), or the
    entries [lo, hi) of its block's ascending selection that fall inside the group (sparse)."""
    p_lo = 0
    p_hi = n_pages
    if SPARSE:
        p_lo = tl.load(Span + row * 2)
        p_hi = tl.load(Span + row * 2 + 1)
    return p_lo, p_hi


@triton.jit
def _slot_batch(Table, Sel, sel_row, off_b, p0, p_hi, stride_tb, stride_tp, SLOTS: tl.constexpr,
                SPARSE: tl.constexpr):
    """Pool slots of the visited pages p0 .. p0 + SLOTS - 1 (those < p_hi) as one register vector,
    loaded before the tile loop that uses them. A slot loaded inside the loop puts a load in the
    address chain of the K/V tile loads, and Triton's software pipeliner then keeps no tile in
    flight ahead of its use; with addresses from registers, 3 stages keep two (H200 forward:
    466 -> 562 TFLOP/s dense at 64K keys, 1.39 -> 1.13 ms at top-k 64; docs/benchmarks.md)."""
    idx = p0 + tl.arange(0, SLOTS)
    valid = idx < p_hi
    page = idx
    if SPARSE:
        page = tl.load(Sel + sel_row + idx, mask=valid, other=0)
    return tl.load(Table + off_b * stride_tb + page * stride_tp, mask=valid, other=0)


@triton.jit
def _pick(vec, i, N: tl.constexpr):
    """vec[i] of an (N,) register vector, i a scalar: a reduction, no memory access."""
    return tl.sum(tl.where(tl.arange(0, N) == i, vec, 0))


@triton.jit
def _page_slot(Table, Sel, sel_row, off_b, i, stride_tb, stride_tp, SPARSE: tl.constexpr):
    """Pool slot of the i-th page visited: page i (dense) or the i-th selected page (sparse)."""
    page = i
    if SPARSE:
        page = tl.load(Sel + sel_row + i)
    return tl.load(Table + off_b * stride_tb + page * stride_tp).to(tl.int64)


@triton.jit
def _own_key_tiles(q_lo, window, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """Own-key tiles of a query tile starting at q_lo: [0, free_hi) need no mask, [masked_lo,
    diagonal end) do. A sliding window masks every tile from the first it can reach."""
    masked_lo = q_lo
    free_hi = q_lo
    if WINDOWED:
        masked_lo = (tl.maximum(q_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
        free_hi = 0
    return masked_lo, free_hi


@triton.jit
def _fwd_program(C, BLOCK_M: tl.constexpr, SPARSE: tl.constexpr):
    """(query tile, b * H + head) of a forward program. Dense: a 2-D grid (tiles, B * H), a
    head's tiles in a row. Top-k: a 1-D grid that starts the last query tiles (the most own
    keys) of every head first, heads fastest, so the longest programs do not run last and a
    KV group's heads, which read the same selected pages, run together (H200, top-k 64:
    1.12 -> 1.06 ms; the dense forward in that order measured 2 % slower, so it keeps its grid)."""
    if SPARSE:
        n_bh = tl.num_programs(0) // tl.cdiv(C, BLOCK_M)
        pid = tl.program_id(0)
        return tl.cdiv(C, BLOCK_M) - 1 - pid // n_bh, pid % n_bh
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _page_tile(slot, off_kvh, t, offs_m, offs_n, kpos0, window, stride_ps, stride_ph, stride_pn,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The t-th page key tile a query tile visits, its page in pool slot `slot`: the offset of
    its first key in the K/V pools, which (query, key) pairs a sliding window lets through (key
    positions relative to the chunk's start: negative for earlier pages), and its first key in
    the page (with the slot, a tensor-descriptor load's coordinates)."""
    tiles_per_page = PAGE_SIZE // BLOCK_N
    n0 = (t % tiles_per_page) * BLOCK_N
    base = slot * stride_ps + off_kvh * stride_ph + n0 * stride_pn
    kpos = kpos0 + (t // tiles_per_page) * PAGE_SIZE + n0 + offs_n
    return base, kpos[None, :] > offs_m[:, None] - window, n0


@triton.jit
def _diagonal_visible(cols, offs_m, C, window, WINDOWED: tl.constexpr):
    """Own keys `cols` of a diagonal tile: which each query sees (causal j <= i, j < C, and
    inside the window), and which are inside the chunk (keys past it are padding)."""
    in_chunk = cols < C
    visible = (cols[None, :] <= offs_m[:, None]) & in_chunk[None, :]
    if WINDOWED:
        visible = visible & (cols[None, :] > offs_m[:, None] - window)
    return visible, in_chunk


@triton.jit
def _attn_fwd_tile(acc, l_i, m_i, q, kT, v, visible, qk_scale, MASK: tl.constexpr, IN_PRECISION: tl.constexpr):
    """One key tile of the online softmax. q (BLOCK_M, HEAD_DIM); kT (HEAD_DIM, BLOCK_N); v
    (BLOCK_N, HEAD_DIM)."""
    # Scores in log2 units: qk_scale = scale / ln 2, so exp2(qk - m) = exp(scale * q.k - m').
    qk = tl.dot(q, kT, input_precision=IN_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
    if MASK:  # diagonal tiles only
        qk = tl.where(visible, qk, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=IN_PRECISION)
    return acc, l_i, m_ij


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, kT_ptrs, v_ptrs, kT_mask, v_mask, visible, qk_scale,
                    MASK: tl.constexpr, IN_PRECISION: tl.constexpr):
    """_attn_fwd_tile of the key tile at kT_ptrs / v_ptrs."""
    kT = tl.load(kT_ptrs, mask=kT_mask, other=0.0)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    return _attn_fwd_tile(acc, l_i, m_i, q, kT, v, visible, qk_scale, MASK, IN_PRECISION)


@triton.jit
def _paged_attn_fwd(
    Q, K, V, KP, VP, Table, Sel, Span, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ps, stride_ph, stride_pn, stride_pd,  # KP and VP pools (same strides)
    stride_tb, stride_tp,
    stride_ob, stride_oh, stride_om, stride_od,
    C, n_pages, qk_scale, H, n_blocks, max_sel, block_q, window, kpos0,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, INCLUDE_SELF: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, TMA: tl.constexpr, SLOTS: tl.constexpr,
):
    """TMA: KP and VP are tensor descriptors of the pools (block (1, 1, BLOCK_N, HEAD_DIM)), so
    page tiles load through the tensor memory accelerator (TMA); else pointers."""
    start_m, off_bh = _fwd_program(C, BLOCK_M, SPARSE)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP  # heads kv*G .. kv*G+G-1 share KV head kv (repeat_kv order)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)  # HEAD_DIM = D padded to a power of 2; masked beyond D
    mask_d = offs_d < D
    mask_m = offs_m < C

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM)

    # Finite start (not -inf): a row whose first tiles are all masked never computes inf - inf.
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Earlier pages: full, all before the chunk, so no mask but the head_dim one. Per batch of
    # SLOTS pages, one flat loop over (page, tile within page) whose addresses come from
    # registers, so the compiler pipelines it.
    tiles_per_page = PAGE_SIZE // BLOCK_N
    kT_mask = mask_d[:, None]
    v_mask = mask_d[None, :]
    sel_row = ((off_b * (H // GROUP) + off_kvh) * n_blocks + (start_m * BLOCK_M) // block_q) * max_sel
    p_lo, p_hi = _page_range(Span, sel_row // max_sel, n_pages, SPARSE)
    for p0 in range(p_lo, p_hi, SLOTS):
        slots = _slot_batch(Table, Sel, sel_row, off_b, p0, p_hi, stride_tb, stride_tp, SLOTS, SPARSE)
        for t in range(p0 * tiles_per_page, tl.minimum(p0 + SLOTS, p_hi) * tiles_per_page):
            slot = _pick(slots, t // tiles_per_page - p0, SLOTS).to(tl.int64)
            base, in_window, n0 = _page_tile(slot, off_kvh, t, offs_m, offs_n, kpos0, window, stride_ps, stride_ph,
                                             stride_pn, PAGE_SIZE, BLOCK_N)
            if TMA:
                coords = [slot.to(tl.int32), off_kvh.to(tl.int32), n0, 0]
                k = KP.load(coords).reshape(BLOCK_N, HEAD_DIM)
                v = VP.load(coords).reshape(BLOCK_N, HEAD_DIM)
                acc, l_i, m_i = _attn_fwd_tile(acc, l_i, m_i, q, tl.trans(k), v, in_window, qk_scale, WINDOWED,
                                               IN_PRECISION)
            else:
                kT_ptrs = KP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
                v_ptrs = VP + base + offs_n[:, None] * stride_pn + offs_d[None, :] * stride_pd
                acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_ptrs, v_ptrs, kT_mask, v_mask, in_window,
                                                qk_scale, WINDOWED, IN_PRECISION)

    # The chunk's own keys ride with the first group of pages only (attention/function.py).
    if INCLUDE_SELF:
        # Own keys before this query tile: all visible (and all < C), no mask. With a sliding
        # window every visited tile is masked instead, from the window's first tile on.
        k_base = K + off_b * stride_kb + off_kvh * stride_kh
        v_base = V + off_b * stride_vb + off_kvh * stride_vh
        masked_lo, free_hi = _own_key_tiles(start_m * BLOCK_M, window, BLOCK_N, WINDOWED)
        for start_n in range(0, free_hi, BLOCK_N):
            kT_ptrs = k_base + (start_n + offs_n)[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + (start_n + offs_n)[:, None] * stride_vn + offs_d[None, :] * stride_vd
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_ptrs, v_ptrs, kT_mask, v_mask, kT_mask,
                                            qk_scale, False, IN_PRECISION)
        # Diagonal tiles: masked.
        for start_n in range(masked_lo, tl.minimum((start_m + 1) * BLOCK_M, C), BLOCK_N):
            cols = start_n + offs_n
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
            v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
            visible, in_chunk = _diagonal_visible(cols, offs_m, C, window, WINDOWED)
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_ptrs, v_ptrs,
                                            kT_mask & in_chunk[None, :], v_mask & in_chunk[:, None], visible,
                                            qk_scale, True, IN_PRECISION)

    # A sparse group may leave a row nothing to see (l = 0): its o is 0 and its LSE -inf, which
    # merges with the other groups as "no contribution".
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    # Base-2 LSE (log2 sum 2^(qk)): the only statistic backward needs.
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + off_bh.to(tl.int64) * C + offs_m, lse, mask=mask_m)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------


@triton.jit
def _paged_attn_bwd_preprocess(
    O, DO, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    C, H, D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_m < C)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BLOCK_M,) = rowsum(O * dO)
    tl.store(Delta + off_bh.to(tl.int64) * C + offs_m, delta, mask=offs_m < C)


# The derivative, per query row i (natural log; P = softmax(S), S = scale * Q K^T):
#   dV = P^T dO
#   dP = dO V^T
#   dS = P * (dP - delta),   delta_i = sum_j P_ij dP_ij = rowsum(O * dO)_i
#   dQ = scale * dS K
#   dK = scale * dS^T Q
# P is recomputed from the saved LSE: with qk = S / ln 2 and lse2 = LSE / ln 2,
# P = exp2(qk - lse2). GQA: dK/dV of a KV head sum over the G query heads of its group.
# Query rows past the chunk (padding) load q = dO = 0 and lse = +inf, so their P is 0.


@triton.jit
def _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, offs_m, offs_n, offs_d, mask_d,
                   stride_qm, stride_qd, stride_dom, stride_dod, C, qk_scale,
                   MASK: tl.constexpr, IN_PRECISION: tl.constexpr, kpos, window, WINDOWED: tl.constexpr):
    """One query tile into dK/dV of a key tile. k, v (BLOCK_N, HEAD_DIM); Q, DO, LSE, Delta
    point at the query head's row 0."""
    mask_m = offs_m < C
    qT = tl.load(Q + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                 mask=mask_m[None, :] & mask_d[:, None], other=0.0)  # (HEAD_DIM, BLOCK_M)
    lse = tl.load(LSE + offs_m, mask=mask_m, other=float("inf"))
    qkT = tl.dot(k, qT, input_precision=IN_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
    pT = tl.math.exp2(qkT - lse[None, :])
    if MASK:  # diagonal tiles only: key j visible to query i iff j <= i
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    if WINDOWED:  # sliding window: key at kpos (relative to the chunk) visible iff kpos > i - window
        pT = tl.where(kpos[:, None] > offs_m[None, :] - window, pT, 0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=IN_PRECISION)
    delta = tl.load(Delta + offs_m, mask=mask_m, other=0.0)
    dpT = tl.dot(v, tl.trans(do), input_precision=IN_PRECISION)  # (BLOCK_N, BLOCK_M)
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=IN_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, visible, qk_scale,
                 MASK: tl.constexpr, IN_PRECISION: tl.constexpr):
    """One key tile into dQ of a query tile. q, do (BLOCK_M, HEAD_DIM); kT, vT (HEAD_DIM, BLOCK_N)."""
    kT = tl.load(kT_ptrs, mask=kv_mask, other=0.0)
    vT = tl.load(vT_ptrs, mask=kv_mask, other=0.0)
    qk = tl.dot(q, kT, input_precision=IN_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    p = tl.math.exp2(qk - lse[:, None])
    if MASK:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, vT, input_precision=IN_PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=IN_PRECISION)
    return dq


@triton.jit
def _paged_attn_bwd_dkdv_pages(
    Q, DO, LSE, Delta, KP, VP, DKP, DVP, Table, Order, Visits, NVisits,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ps, stride_ph, stride_pn, stride_pd,  # KP and VP pools
    stride_gs, stride_gh, stride_gn, stride_gd,  # DKP and DVP gradient pools
    stride_tb, stride_tp,
    C, qk_scale, scale, H, HKV, n_pages, n_blocks, block_q, window, kpos0,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, MAX_BLOCKS: tl.constexpr,
):
    """One program per (key tile of an earlier page, b, KV head): the only writer of its slice
    of the gradient pages, so the read-modify-write needs no atomics.

    Sparse: the program visits only the query blocks that chose its page, listed in Visits
    (B, Hkv, n_pages, n_blocks) int32 (the first NVisits (B, Hkv, n_pages) entries), as one flat
    loop over (block, head of the group, query tile) that the compiler can pipeline; pages are
    taken most-visited first (Order (B, Hkv, n_pages)) so the longest programs start first: in
    a 1-D grid whose (b, KV head) varies fastest, every head's longest programs start in the
    first wave. (With heads slowest, the last head's started late: its SMs were active 82 % of
    the top-k 64 kernel's cycles (ncu), and the kernel took 2.42 ms, 2.28 with this order; docs/benchmarks.md.)"""
    tiles_per_page = PAGE_SIZE // BLOCK_N
    n_bkv = tl.num_programs(0) // (n_pages * tiles_per_page)
    off_bkv = tl.program_id(0) % n_bkv
    pid = tl.program_id(0) // n_bkv
    start_n = (pid % tiles_per_page) * BLOCK_N
    off_b = (off_bkv // HKV).to(tl.int64)
    off_kvh = (off_bkv % HKV).to(tl.int64)
    page = pid // tiles_per_page
    if SPARSE:
        page = tl.load(Order + off_bkv.to(tl.int64) * n_pages + page)
    slot = tl.load(Table + off_b * stride_tb + page * stride_tp).to(tl.int64)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < D
    kv_offs = slot * stride_ps + off_kvh * stride_ph + offs_n[:, None] * stride_pn + offs_d[None, :] * stride_pd
    k = tl.load(KP + kv_offs, mask=mask_d[None, :], other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(VP + kv_offs, mask=mask_d[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    # Every query that reads an earlier key sees all of it: no causal mask.
    kpos = kpos0 + page * PAGE_SIZE + offs_n
    if SPARSE:
        row = off_bkv.to(tl.int64) * n_pages + page
        tiles_per_block = block_q // BLOCK_M
        per_block = GROUP * tiles_per_block
        # The visiting blocks in registers: a load in the loop would stall its pipeline.
        n_visits = tl.load(NVisits + row)
        offs_v = tl.arange(0, MAX_BLOCKS)
        visits = tl.load(Visits + row * n_blocks + offs_v, mask=offs_v < n_visits, other=0)
        for it in range(0, n_visits * per_block):
            blk = _pick(visits, it // per_block, MAX_BLOCKS)
            off_h = off_kvh * GROUP + (it // tiles_per_block) % GROUP
            offs_m = blk * block_q + (it % tiles_per_block) * BLOCK_M + tl.arange(0, BLOCK_M)
            dk, dv = _attn_bwd_dkdv(dk, dv, k, v, Q + off_b * stride_qb + off_h * stride_qh,
                                    DO + off_b * stride_dob + off_h * stride_doh, LSE + (off_b * H + off_h) * C,
                                    Delta + (off_b * H + off_h) * C, offs_m, offs_n, offs_d, mask_d, stride_qm,
                                    stride_qd, stride_dom, stride_dod, C, qk_scale, False, IN_PRECISION, kpos,
                                    window, False)
    else:
        # Sliding window: only queries i < kpos + window see these keys (positions relative to the chunk).
        q_hi = C
        if WINDOWED:
            q_hi = tl.minimum(C, kpos0 + page * PAGE_SIZE + start_n + BLOCK_N - 1 + window)
        for g in range(GROUP):
            off_h = off_kvh * GROUP + g
            q_head = Q + off_b * stride_qb + off_h * stride_qh
            do_head = DO + off_b * stride_dob + off_h * stride_doh
            for start_m in range(0, q_hi, BLOCK_M):
                offs_m = start_m + tl.arange(0, BLOCK_M)
                dk, dv = _attn_bwd_dkdv(dk, dv, k, v, q_head, do_head, LSE + (off_b * H + off_h) * C,
                                        Delta + (off_b * H + off_h) * C, offs_m, offs_n, offs_d, mask_d, stride_qm,
                                        stride_qd, stride_dom, stride_dod, C, qk_scale, False, IN_PRECISION, kpos,
                                        window, WINDOWED)

    dk *= scale  # dK = scale * dS^T Q
    g_offs = slot * stride_gs + off_kvh * stride_gh + offs_n[:, None] * stride_gn + offs_d[None, :] * stride_gd
    g_mask = mask_d[None, :]
    # Accumulate in fp32, store in the pool's dtype (fp32, or bf16 pages: kv_grad_dtype).
    dk += tl.load(DKP + g_offs, mask=g_mask, other=0.0).to(tl.float32)
    dv += tl.load(DVP + g_offs, mask=g_mask, other=0.0).to(tl.float32)
    tl.store(DKP + g_offs, dk.to(DKP.dtype.element_ty), mask=g_mask)
    tl.store(DVP + g_offs, dv.to(DVP.dtype.element_ty), mask=g_mask)


@triton.jit
def _paged_attn_bwd_dkdv_own(
    Q, DO, LSE, Delta, K, V, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # DK and DV outputs (same strides)
    C, qk_scale, scale, H, window,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
):
    """One program per (b, query head, key tile of the chunk): the query head's share of the key
    tile's dK/dV, from the query tiles that can see it (those at or after it), into DK/DV
    (B, H, C, D); the caller sums a group's shares. Causal work shrinks with the key tile, so
    the key tile is the slower grid axis: the longest programs start first, and one program per
    query head (not per KV head, looping over its group) keeps the longest one short: one
    program per KV head ran 128 programs on 132 SMs at the 7B shape, the first 32x the last."""
    off_bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < D
    mask_nd = (offs_n < C)[:, None] & mask_d[None, :]
    k = tl.load(K + off_b * stride_kb + off_kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=mask_nd, other=0.0)  # (BLOCK_N, HEAD_DIM)
    v = tl.load(V + off_b * stride_vb + off_kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=mask_nd, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    q_head = Q + off_b * stride_qb + off_h * stride_qh
    do_head = DO + off_b * stride_dob + off_h * stride_doh
    lse_head = LSE + (off_b * H + off_h) * C
    delta_head = Delta + (off_b * H + off_h) * C
    # Diagonal: query tiles overlapping the key tile (BLOCK_N % BLOCK_M == 0), masked.
    for start_m in range(start_n, tl.minimum(start_n + BLOCK_N, C), BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        dk, dv = _attn_bwd_dkdv(dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                                offs_m, offs_n, offs_d, mask_d, stride_qm, stride_qd, stride_dom, stride_dod,
                                C, qk_scale, True, IN_PRECISION, offs_n, window, WINDOWED)
    # Later query tiles see the whole key tile: no mask (but the window's, which also ends the
    # loop: queries at or past start_n + BLOCK_N - 1 + window see none of these keys).
    q_hi = C
    if WINDOWED:
        q_hi = tl.minimum(C, start_n + BLOCK_N - 1 + window)
    for start_m in range(start_n + BLOCK_N, q_hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        dk, dv = _attn_bwd_dkdv(dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                                offs_m, offs_n, offs_d, mask_d, stride_qm, stride_qd, stride_dom, stride_dod,
                                C, qk_scale, False, IN_PRECISION, offs_n, window, WINDOWED)

    dk *= scale
    out_offs = off_b * stride_dkb + off_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out_offs, dk.to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _paged_attn_bwd_dq(
    Q, DO, LSE, Delta, K, V, KP, VP, Table, Sel, Span, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ps, stride_ph, stride_pn, stride_pd,
    stride_tb, stride_tp,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    C, n_pages, qk_scale, scale, H, n_blocks, max_sel, block_q, window, kpos0,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, INCLUDE_SELF: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr,
):
    """One program per (query tile, b, head); loops over the page key tiles, then the chunk."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_kvh = off_h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_d = offs_d < D
    mask_m = offs_m < C
    mask_md = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=mask_md, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=mask_md, other=0.0)
    lse = tl.load(LSE + off_bh.to(tl.int64) * C + offs_m, mask=mask_m, other=0.0)
    delta = tl.load(Delta + off_bh.to(tl.int64) * C + offs_m, mask=mask_m, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    tiles_per_page = PAGE_SIZE // BLOCK_N
    kv_mask = mask_d[:, None]
    sel_row = ((off_b * (H // GROUP) + off_kvh) * n_blocks + (start_m * BLOCK_M) // block_q) * max_sel
    p_lo, p_hi = _page_range(Span, sel_row // max_sel, n_pages, SPARSE)
    # The slot loads stay inside this loop: from registers (as in the forward) its pages
    # measured slower on the H200 (top-k 64: 1.94 vs 1.62 ms, docs/benchmarks.md).
    for t in range(p_lo * tiles_per_page, p_hi * tiles_per_page):
        slot = _page_slot(Table, Sel, sel_row, off_b, t // tiles_per_page, stride_tb, stride_tp, SPARSE)
        base, in_window, _ = _page_tile(slot, off_kvh, t, offs_m, offs_n, kpos0, window, stride_ps, stride_ph,
                                        stride_pn, PAGE_SIZE, BLOCK_N)
        kT_ptrs = KP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
        vT_ptrs = VP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
        dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, in_window, qk_scale, WINDOWED,
                          IN_PRECISION)

    if INCLUDE_SELF:
        k_base = K + off_b * stride_kb + off_kvh * stride_kh
        v_base = V + off_b * stride_vb + off_kvh * stride_vh
        masked_lo, free_hi = _own_key_tiles(start_m * BLOCK_M, window, BLOCK_N, WINDOWED)
        for start_n in range(0, free_hi, BLOCK_N):
            cols = start_n + offs_n
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
            vT_ptrs = v_base + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd
            dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, kv_mask, qk_scale, False, IN_PRECISION)
        for start_n in range(masked_lo, tl.minimum((start_m + 1) * BLOCK_M, C), BLOCK_N):
            cols = start_n + offs_n
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
            vT_ptrs = v_base + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd
            visible, in_chunk = _diagonal_visible(cols, offs_m, C, window, WINDOWED)
            dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask & in_chunk[None, :], visible,
                              qk_scale, True, IN_PRECISION)

    dq *= scale  # dQ = scale * dS K
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=mask_md)


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
        if pages.dk.dtype != torch.float32 or pages.dv.dtype != torch.float32:
            raise ValueError(f"gradient pages must be float32; got {pages.dk.dtype}/{pages.dv.dtype}")
    # Internal layout invariants of the store (pools made with empty_like share strides).
    assert pages.k.stride() == pages.v.stride(), "k and v pools must share strides"
    assert pages.dk is None or pages.dk.stride() == pages.dv.stride(), "dk and dv pools must share strides"


def _head_dim_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _fwd_config(q: torch.Tensor, head_dim: int) -> dict:
    """Tile sizes: small ones for the interpreter; H100/H200 ones for D <= 128 in 16-bit."""
    if q.device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if q.dtype == torch.float32 or head_dim > 128:  # twice the bytes per tile: halve it
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    # bench/tune_attention.py on an H200 (bf16, D=128, C=4096; bench/results/tune.jsonl, 2026-11-30),
    # page slots from registers (_slot_batch): 3 stages 549.9 TFLOP/s at 64K keys dense, 490.5 at
    # top-k 64 of 1M; 2 stages 442.6 / 437.8 (with slots loaded in the loop, 2 stages had been the
    # faster: 461.1 vs 448.5 dense). 4 stages are out of shared memory; 64-key tiles slower.
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def _bwd_config(q: torch.Tensor, head_dim: int) -> dict:
    """dK/dV kernels: BLOCK_N1 keys held, BLOCK_M1 queries streamed (BLOCK_N1 % BLOCK_M1 == 0),
    warps1 warps, stages1 pipeline stages; dQ: BLOCK_M2 queries held, BLOCK_N2 keys streamed
    (BLOCK_M2 % BLOCK_N2 == 0), warps2, stages2."""
    if q.device.type != "cuda":
        return dict(BLOCK_M1=16, BLOCK_N1=32, warps1=4, stages1=1, BLOCK_M2=32, BLOCK_N2=16, warps2=4, stages2=1)
    if q.dtype == torch.float32 or head_dim > 128:
        return dict(BLOCK_M1=16, BLOCK_N1=64, warps1=4, stages1=1, BLOCK_M2=64, BLOCK_N2=16, warps2=4, stages2=1)
    # bench/tune_attention.py on an H200 (as _fwd_config): 362.9 TFLOP/s (2.5x fwd FLOPs); 64x64
    # tiles with 4 warps and 2 stages 373.0 in the sweep but slower in the step; 32-query tiles
    # 324.7 or less.
    return dict(BLOCK_M1=64, BLOCK_N1=128, warps1=8, stages1=3, BLOCK_M2=128, BLOCK_N2=64, warps2=8, stages2=3)


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


def _forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True, o_dtype=None):
    """o (B, H, C, D) in o_dtype (default q's) and the base-2 lse (B, H, C) fp32."""
    _check(q, k, v, pages)
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    page_size = pages.k.shape[2]
    cfg = _fwd_config(q, d)
    block_n = min(cfg["BLOCK_N"], page_size)  # P % BLOCK_N == 0 (both powers of two)
    o = torch.empty((b, h, c, d), dtype=o_dtype or q.dtype, device=q.device)
    lse = torch.empty((b, h, c), dtype=torch.float32, device=q.device)
    sp = _sparse_args(pages, c)
    n_m = triton.cdiv(c, cfg["BLOCK_M"])
    grid = (n_m * b * h,) if sp["SPARSE"] else (n_m, b * h)  # _fwd_program's launch orders
    _check_blocks(sp, cfg["BLOCK_M"])
    kp, vp, tma = pages.k, pages.v, _tma_pools(q, pages, d)
    if tma:
        kp, vp = (TensorDescriptor.from_tensor(x, [1, 1, block_n, d]) for x in (pages.k, pages.v))
    _paged_attn_fwd[grid](
        q, k, v, kp, vp, pages.table, sp["Sel"], sp["Span"], o, lse,
        *q.stride(), *k.stride(), *v.stride(), *pages.k.stride(), *pages.table.stride(), *o.stride(),
        c, pages.n_pages, scale * RCP_LN2, h, sp["n_blocks"], sp["max_sel"], sp["block_q"], *_window_args(pages),
        GROUP=h // n_kv, D=d, HEAD_DIM=_head_dim_block(d), PAGE_SIZE=page_size,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block_n, IN_PRECISION=_precision(q), INCLUDE_SELF=include_self,
        SPARSE=sp["SPARSE"], WINDOWED=pages.window > 0, TMA=tma, SLOTS=SLOT_BATCH,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return o, lse


def _tma_pools(q: torch.Tensor, pages: LayerPages, d: int) -> bool:
    """Whether the forward reads page tiles through tensor descriptors (the TMA unit): not
    turned off (TMA, env OOMB_TMA=0), a Hopper or later GPU (or the interpreter), 16-bit
    pools, a power-of-two head_dim and 16-byte aligned pool strides."""
    if not TMA or pages.n_pages == 0:
        return False
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    item = pages.k.element_size()
    return (pages.k.dtype in (torch.float16, torch.bfloat16) and d == _head_dim_block(d)
            and pages.k.stride() == pages.v.stride() and pages.k.stride(-1) == 1
            and all(st * item % 16 == 0 for st in pages.k.stride()[:-1])
            and all(x.data_ptr() % 16 == 0 for x in (pages.k, pages.v)))


def _window_args(pages: LayerPages) -> tuple[int, int]:
    """(window, position of the group's first key relative to the chunk's first query)."""
    return pages.window, pages.first_page * pages.k.shape[2] - pages.q_start


def _check_blocks(sp: dict, block_m: int) -> None:
    if sp["SPARSE"] and sp["block_q"] % block_m:
        raise ValueError(f"TopKPages(block_queries={sp['block_q']}) must be a multiple of the kernel's query "
                         f"tile {block_m} on this device; use block_queries=128 (or 256)")


def _backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True, dq_dtype=None):
    """dq (dq_dtype, default q's), dk, dv of the chunk (None without include_self); adds the
    pages' gradient into pages.dk/dv. lse is base 2, as _forward returns it."""
    b, h, c, d = q.shape
    n_kv = k.shape[1]
    group = h // n_kv
    page_size = pages.k.shape[2]
    head_dim = _head_dim_block(d)
    cfg = _bwd_config(q, d)
    launch1 = dict(num_warps=cfg["warps1"], num_stages=cfg["stages1"])  # the dK/dV kernels
    precision = _precision(q)

    delta = torch.empty_like(lse)  # (B, H, C) fp32
    _paged_attn_bwd_preprocess[(triton.cdiv(c, 64), b * h)](
        o, do, delta, *o.stride(), *do.stride(), c, h, D=d, HEAD_DIM=head_dim, BLOCK_M=64,
    )

    sp = _sparse_args(pages, c)
    _check_blocks(sp, cfg["BLOCK_M1"])
    _check_blocks(sp, cfg["BLOCK_M2"])
    if pages.dk is not None and pages.n_pages > 0:
        visits = _page_visits(pages)
        block_n = min(cfg["BLOCK_N1"], page_size)  # no causal mask here: any BLOCK_M1 works
        grid = (pages.n_pages * (page_size // block_n) * b * n_kv,)
        _paged_attn_bwd_dkdv_pages[grid](
            q, do, lse, delta, pages.k, pages.v, pages.dk, pages.dv, pages.table, visits["Order"],
            visits["Visits"], visits["NVisits"],
            *q.stride(), *do.stride(), *pages.k.stride(), *pages.dk.stride(), *pages.table.stride(),
            c, scale * RCP_LN2, scale, h, n_kv, pages.n_pages, sp["n_blocks"] if sp["SPARSE"] else 1, sp["block_q"],
            *_window_args(pages),
            GROUP=group, D=d, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=block_n, IN_PRECISION=precision, SPARSE=sp["SPARSE"],
            WINDOWED=pages.window > 0, MAX_BLOCKS=triton.next_power_of_2(sp["n_blocks"] if sp["SPARSE"] else 1),
            **launch1,
        )

    dk = dv = None
    if include_self:
        # Each query head's share (fp32 when a group's shares are summed), then the group's sum.
        share = torch.float32 if group > 1 else k.dtype
        dk = torch.empty((b, h, c, d), dtype=share, device=k.device)
        dv = torch.empty((b, h, c, d), dtype=share, device=v.device)
        _paged_attn_bwd_dkdv_own[(b * h, triton.cdiv(c, cfg["BLOCK_N1"]))](
            q, do, lse, delta, k, v, dk, dv,
            *q.stride(), *do.stride(), *k.stride(), *v.stride(), *dk.stride(),
            c, scale * RCP_LN2, scale, h, pages.window,
            GROUP=group, D=d, HEAD_DIM=head_dim,
            BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], IN_PRECISION=precision, WINDOWED=pages.window > 0,
            **launch1,
        )
        if group > 1:
            dk = dk.view(b, n_kv, group, c, d).sum(2).to(k.dtype)
            dv = dv.view(b, n_kv, group, c, d).sum(2).to(v.dtype)

    dq = torch.empty(q.shape, dtype=dq_dtype or q.dtype, device=q.device)  # (B, H, C, D)
    _paged_attn_bwd_dq[(triton.cdiv(c, cfg["BLOCK_M2"]), b * h)](
        q, do, lse, delta, k, v, pages.k, pages.v, pages.table, sp["Sel"], sp["Span"], dq,
        *q.stride(), *do.stride(), *k.stride(), *v.stride(), *pages.k.stride(), *pages.table.stride(),
        *dq.stride(),
        c, pages.n_pages, scale * RCP_LN2, scale, h, sp["n_blocks"], sp["max_sel"], sp["block_q"],
        *_window_args(pages),
        GROUP=group, D=d, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=min(cfg["BLOCK_N2"], page_size), IN_PRECISION=precision,
        INCLUDE_SELF=include_self, SPARSE=sp["SPARSE"], WINDOWED=pages.window > 0,
        num_warps=cfg["warps2"], num_stages=cfg["stages2"],
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------
# The backend interface (attention/function.py runs it over groups of pages, with autograd)
# ----------------------------------------------------------------------------------------


def forward(q, k, v, pages: LayerPages, scale: float, include_self: bool = True):
    """One group's (o fp32 (B, H, C, D), lse fp32 (B, H, C), natural log); see reference.forward."""
    o, lse2 = _forward(q, k, v, pages, scale, include_self, o_dtype=torch.float32)
    return o, lse2 * LN2  # log2-sum-exp2 -> natural log


def backward(do, q, k, v, o, lse, pages: LayerPages, scale: float, include_self: bool = True):
    """One group's (dq fp32, dk, dv or None) given the final o, lse (natural log) of all groups;
    adds the pages' dK/dV into pages.dk / pages.dv. See reference.backward."""
    return _backward(do, q, k, v, o, lse * RCP_LN2, pages, scale, include_self, dq_dtype=torch.float32)
