"""The paged attention backward kernels (Triton): dK/dV of the earlier pages (read-modify-write
into the gradient pages), dK/dV of the chunk's own keys, and dQ, each output element with one
writer (no atomics: bitwise deterministic). Launched by attention/paged.py, whose docstring gives
the grids; the semantics are attention/reference.py's.
"""
import triton
import triton.language as tl

from .paged_forward import (_diagonal_visible, _document_starts, _first_page_tile, _own_key_tiles, _page_kv, _page_pos,
                            _page_pos_batch, _page_range, _page_slot, _page_tile, _pick, _pick_page_pos, _slot_batch,
                            _tile_start)


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
# Packed documents: P is 0 where a key precedes the query's document (KeyStart), and a key
# tile's backward visits only the query tiles before its document's end (DocEnd).


@triton.jit
def _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_m, offs_n, offs_d, mask_d,
                   stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
                   C, H, qk_scale, MASK: tl.constexpr, IN_PRECISION: tl.constexpr, kpos, window,
                   WINDOWED: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
                   KeyStart, stride_ksb, q_start, PACKED: tl.constexpr):
    """Query head off_h's tile of rows start_m .. into dK/dV of a key tile k, v (BLOCK_N,
    HEAD_DIM). Rows past the chunk load q = dO = 0 and LSE +inf, so their P is 0. TMA: Q and DO
    are tensor descriptors of (B, H, C, D) with (1, 1, BLOCK_M, HEAD_DIM) blocks, else pointers
    (B, H, C, D) with the given strides."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    mask_m = offs_m < C
    row = (off_b * H + off_h) * C
    coords = [off_b.to(tl.int32), off_h.to(tl.int32), start_m, 0]
    if TMA:
        qT = tl.trans(Q.load(coords).reshape(BLOCK_M, HEAD_DIM))
    else:
        qT = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                     mask=mask_m[None, :] & mask_d[:, None], other=0.0)  # (HEAD_DIM, BLOCK_M)
    lse = tl.load(LSE + row + offs_m, mask=mask_m, other=float("inf"))
    if TMA:
        do = DO.load(coords).reshape(BLOCK_M, HEAD_DIM)
    else:
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    # dP^T before P^T's exp2 (which dV's product needs): the tensor cores compute it while the
    # exp2s run (in the other order ptxas issues the exp2s between two waits for the tensor cores).
    qkT = tl.dot(k, qT, input_precision=IN_PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M), log2 units
    dpT = tl.dot(v, tl.trans(do), input_precision=IN_PRECISION)  # (BLOCK_N, BLOCK_M)
    pT = tl.math.exp2(qkT - lse[None, :])
    if MASK:  # diagonal tiles only: key j visible to query i iff j <= i
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    if WINDOWED:  # sliding window: key at kpos (relative to the chunk) visible iff kpos > i - window
        pT = tl.where(kpos[:, None] > offs_m[None, :] - window, pT, 0.0)
    if PACKED:  # documents: key at kpos visible iff at or after the query's document start
        ks = _document_starts(KeyStart, off_b, q_start, offs_m, C, stride_ksb, PACKED)
        pT = tl.where(kpos[:, None] >= ks[None, :], pT, 0.0)
    dv += tl.dot(pT.to(do.dtype), do, input_precision=IN_PRECISION)
    delta = tl.load(Delta + row + offs_m, mask=mask_m, other=0.0)
    dsT = pT * (dpT - delta[None, :])
    dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=IN_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dq_tile(dq, q, do, lse, delta, kT, vT, visible, qk_scale, MASK: tl.constexpr,
                      IN_PRECISION: tl.constexpr):
    """One key tile into dQ of a query tile. q, do (BLOCK_M, HEAD_DIM); kT, vT (HEAD_DIM, BLOCK_N)."""
    qk = tl.dot(q, kT, input_precision=IN_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
    p = tl.math.exp2(qk - lse[:, None])
    if MASK:
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, vT, input_precision=IN_PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=IN_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, visible, qk_scale,
                 MASK: tl.constexpr, IN_PRECISION: tl.constexpr):
    """_attn_bwd_dq_tile of the key tile at kT_ptrs / vT_ptrs."""
    kT = tl.load(kT_ptrs, mask=kv_mask, other=0.0)
    vT = tl.load(vT_ptrs, mask=kv_mask, other=0.0)
    return _attn_bwd_dq_tile(dq, q, do, lse, delta, kT, vT, visible, qk_scale, MASK, IN_PRECISION)


@triton.jit
def _paged_attn_bwd_dkdv_pages(
    Q, DO, LSE, Delta, KP, VP, DKP, DVP, Table, Order, Visits, NVisits, KeyStart, DocEnd, PagePos,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ps, stride_ph, stride_pn, stride_pd,  # KP and VP pools
    stride_gs, stride_gh, stride_gn, stride_gd,  # DKP and DVP gradient pools
    stride_tb, stride_tp,
    stride_ksb, stride_ppb,  # KeyStart and DocEnd (same strides), PagePos
    C, qk_scale, scale, H, HKV, n_pages, n_blocks, block_q, window, kpos0, q_start,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, MAX_BLOCKS: tl.constexpr, TMA: tl.constexpr,
    PACKED: tl.constexpr,
):
    """One program per (key tile of an earlier page, b, KV head): the only writer of its slice
    of the gradient pages, so the read-modify-write needs no atomics. TMA: Q and DO are tensor
    descriptors (_attn_bwd_dkdv).

    Sparse: the program visits only the query blocks that chose its page, listed in Visits
    (B, Hkv, n_pages, n_blocks) int32 (the first NVisits (B, Hkv, n_pages) entries), as one flat
    loop over (block, head of the group, query tile) that the compiler can pipeline; pages are
    taken most-visited first (Order (B, Hkv, n_pages)) so the longest programs start first: in
    a 1-D grid whose (b, KV head) varies fastest, every head's longest programs start in the
    first wave. (With heads slowest, the last head's started late: its SMs were active 82 % of
    the top-k 64 kernel's cycles (ncu), and the kernel took 2.42 ms, 2.28 with this order: H200,
    2026-11-30, dbfe684; docs/experiments.md.)"""
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
    page_pos = kpos0 + page * PAGE_SIZE  # relative to the chunk's start
    if SPARSE and PACKED:
        page_pos = tl.load(PagePos + off_b * stride_ppb + page)
    kpos = page_pos + offs_n
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
            start_m = blk * block_q + (it % tiles_per_block) * BLOCK_M
            dk, dv = _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_m, offs_n, offs_d, mask_d,
                                    stride_qb, stride_qh, stride_qm, stride_qd,
                                    stride_dob, stride_doh, stride_dom, stride_dod,
                                    C, H, qk_scale, False, IN_PRECISION, kpos, window, False, BLOCK_M, HEAD_DIM, TMA,
                                    KeyStart, stride_ksb, q_start, PACKED)
    else:
        # Sliding window: only queries i < kpos + window see these keys (positions relative to the chunk).
        q_hi = C
        if WINDOWED:
            q_hi = tl.minimum(C, kpos0 + page * PAGE_SIZE + start_n + BLOCK_N - 1 + window)
        if PACKED:  # documents: only queries before the end of the tile's last key's document
            q_hi = tl.minimum(q_hi, tl.load(DocEnd + off_b * stride_ksb + q_start + page_pos + start_n + BLOCK_N - 1)
                              - q_start)
        for g in range(GROUP):
            off_h = off_kvh * GROUP + g
            for start_m in range(0, q_hi, BLOCK_M):
                dk, dv = _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_m, offs_n, offs_d, mask_d,
                                        stride_qb, stride_qh, stride_qm, stride_qd,
                                        stride_dob, stride_doh, stride_dom, stride_dod,
                                        C, H, qk_scale, False, IN_PRECISION, kpos, window,
                                        WINDOWED, BLOCK_M, HEAD_DIM, TMA, KeyStart, stride_ksb, q_start, PACKED)

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
    Q, DO, LSE, Delta, K, V, DK, DV, KeyStart, DocEnd,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # DK and DV outputs (same strides)
    stride_ksb,  # KeyStart and DocEnd (same strides)
    C, qk_scale, scale, H, window, q_start,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, WINDOWED: tl.constexpr,
    PACKED: tl.constexpr,
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

    # Diagonal: query tiles overlapping the key tile (BLOCK_N % BLOCK_M == 0), masked.
    for start_m in range(start_n, tl.minimum(start_n + BLOCK_N, C), BLOCK_M):
        dk, dv = _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_m, offs_n, offs_d, mask_d,
                                stride_qb, stride_qh, stride_qm, stride_qd,
                                stride_dob, stride_doh, stride_dom, stride_dod,
                                C, H, qk_scale, True, IN_PRECISION, offs_n, window, WINDOWED, BLOCK_M, HEAD_DIM, False,
                                KeyStart, stride_ksb, q_start, PACKED)
    # Later query tiles see the whole key tile: no mask (but the window's, which also ends the
    # loop: queries at or past start_n + BLOCK_N - 1 + window see none of these keys; and the
    # documents', which ends it at the end of the tile's last key's document).
    q_hi = C
    if WINDOWED:
        q_hi = tl.minimum(C, start_n + BLOCK_N - 1 + window)
    if PACKED:
        last = tl.minimum(start_n + BLOCK_N, C) - 1
        q_hi = tl.minimum(q_hi, tl.load(DocEnd + off_b * stride_ksb + q_start + last) - q_start)
    for start_m in range(start_n + BLOCK_N, q_hi, BLOCK_M):
        dk, dv = _attn_bwd_dkdv(dk, dv, k, v, Q, DO, LSE, Delta, off_b, off_h, start_m, offs_n, offs_d, mask_d,
                                stride_qb, stride_qh, stride_qm, stride_qd,
                                stride_dob, stride_doh, stride_dom, stride_dod,
                                C, H, qk_scale, False, IN_PRECISION, offs_n, window, WINDOWED, BLOCK_M, HEAD_DIM, False,
                                KeyStart, stride_ksb, q_start, PACKED)

    dk *= scale
    out_offs = off_b * stride_dkb + off_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out_offs, dk.to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _paged_attn_bwd_dq(
    Q, DO, LSE, Delta, K, V, KP, VP, Table, Sel, Span, KeyStart, PagePos, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ps, stride_ph, stride_pn, stride_pd,
    stride_tb, stride_tp,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_ksb, stride_ppb,
    C, n_pages, qk_scale, scale, H, n_blocks, max_sel, block_q, window, kpos0, q_start,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, INCLUDE_SELF: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, TMA: tl.constexpr, SLOTS: tl.constexpr, PACKED: tl.constexpr,
):
    """One program per (query tile, b, head); loops over the page key tiles, then the chunk.
    TMA: KP and VP are tensor descriptors of the pools (block (1, 1, BLOCK_N, HEAD_DIM)) and the
    page loop runs as the forward's (slots from registers, SLOTS pages at a time); else pointers."""
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
    ks = _document_starts(KeyStart, off_b, q_start, offs_m, C, stride_ksb, PACKED)  # (BLOCK_M,)
    ks_lo = tl.min(ks)
    t_lo = 0
    if not SPARSE:  # as the forward: page tiles wholly before the tile's documents are skipped
        t_lo = _first_page_tile(ks_lo, kpos0, BLOCK_N, PACKED)
        p_lo = tl.maximum(p_lo, t_lo // tiles_per_page)
    if TMA:
        for p0 in range(p_lo, p_hi, SLOTS):
            slots = _slot_batch(Table, Sel, sel_row, off_b, p0, p_hi, stride_tb, stride_tp, SLOTS, SPARSE)
            poss = _page_pos_batch(PagePos, Sel, sel_row, off_b, p0, p_hi, stride_ppb, SLOTS, SPARSE, PACKED)
            t_hi = tl.minimum(p0 + SLOTS, p_hi) * tiles_per_page
            for t in range(_tile_start(p0, t_lo, tiles_per_page, PACKED), t_hi):
                page_pos = _pick_page_pos(poss, p0, t // tiles_per_page, kpos0, PAGE_SIZE, SLOTS, SPARSE, PACKED)
                k, v, visible = _page_kv(KP, VP, slots, p0, t, off_kvh, offs_m, offs_n, page_pos, window, ks,
                                         stride_ps, stride_ph, stride_pn, PAGE_SIZE, BLOCK_N, HEAD_DIM, SLOTS,
                                         WINDOWED, PACKED)
                dq = _attn_bwd_dq_tile(dq, q, do, lse, delta, tl.trans(k), tl.trans(v), visible, qk_scale,
                                       WINDOWED or PACKED, IN_PRECISION)
    else:
        # The slot loads stay inside this loop: with pointers, from registers (as in the
        # forward) its pages measured slower on the H200 (top-k 64: 1.94 vs 1.62 ms, 2026-11-30,
        # ad1f8af; docs/experiments.md).
        for t in range(_tile_start(p_lo, t_lo, tiles_per_page, PACKED), p_hi * tiles_per_page):
            slot = _page_slot(Table, Sel, sel_row, off_b, t // tiles_per_page, stride_tb, stride_tp, SPARSE)
            page_pos = _page_pos(PagePos, Sel, sel_row, off_b, t // tiles_per_page, kpos0, stride_ppb, PAGE_SIZE,
                                 SPARSE, PACKED)
            base, visible, _ = _page_tile(slot, off_kvh, t, offs_m, offs_n, page_pos, window, ks, stride_ps,
                                          stride_ph, stride_pn, PAGE_SIZE, BLOCK_N, WINDOWED, PACKED)
            kT_ptrs = KP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
            vT_ptrs = VP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
            dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, visible, qk_scale,
                              WINDOWED or PACKED, IN_PRECISION)

    if INCLUDE_SELF:
        k_base = K + off_b * stride_kb + off_kvh * stride_kh
        v_base = V + off_b * stride_vb + off_kvh * stride_vh
        masked_lo, free_hi = _own_key_tiles(start_m * BLOCK_M, window, ks_lo, BLOCK_N, WINDOWED, PACKED)
        for start_n in range(0, free_hi, BLOCK_N):
            cols = start_n + offs_n
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
            vT_ptrs = v_base + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd
            dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask, kv_mask, qk_scale, False, IN_PRECISION)
        for start_n in range(masked_lo, tl.minimum((start_m + 1) * BLOCK_M, C), BLOCK_N):
            cols = start_n + offs_n
            kT_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd
            vT_ptrs = v_base + cols[None, :] * stride_vn + offs_d[:, None] * stride_vd
            visible, in_chunk = _diagonal_visible(cols, offs_m, C, window, ks, WINDOWED, PACKED)
            dq = _attn_bwd_dq(dq, q, do, lse, delta, kT_ptrs, vT_ptrs, kv_mask & in_chunk[None, :], visible,
                              qk_scale, True, IN_PRECISION)

    dq *= scale  # dQ = scale * dS K
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=mask_md)
