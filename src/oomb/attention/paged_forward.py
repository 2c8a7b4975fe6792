"""The paged attention forward kernel (Triton) and the tile helpers the backward kernels share.

A program holds a query tile of one head and loops over the key tiles of the earlier pages (all
of them, or a top-k selection), then over the chunk's own keys, with an online softmax; it
writes O and the base-2 log-sum-exp. Launched by attention/paged.py, whose docstring gives the
grids; the semantics are attention/reference.py's.
"""
import triton
import triton.language as tl


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
    466 -> 562 TFLOP/s dense at 64K keys, 1.39 -> 1.13 ms at top-k 64; 2026-11-30, e8cd5a4)."""
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
def _page_kv(KP, VP, slots, p0, t, off_kvh, offs_m, offs_n, kpos0, window, stride_ps, stride_ph, stride_pn,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SLOTS: tl.constexpr):
    """The t-th page key tile through the pools' tensor descriptors KP, VP (block (1, 1, BLOCK_N,
    HEAD_DIM)), its page's slot picked from `slots` (_slot_batch of the pages from p0): k, v
    (BLOCK_N, HEAD_DIM) and which (query, key) pairs a sliding window lets through."""
    slot = _pick(slots, t // (PAGE_SIZE // BLOCK_N) - p0, SLOTS).to(tl.int64)
    _, in_window, n0 = _page_tile(slot, off_kvh, t, offs_m, offs_n, kpos0, window, stride_ps, stride_ph, stride_pn,
                                  PAGE_SIZE, BLOCK_N)
    coords = [slot.to(tl.int32), off_kvh.to(tl.int32), n0, 0]
    return KP.load(coords).reshape(BLOCK_N, HEAD_DIM), VP.load(coords).reshape(BLOCK_N, HEAD_DIM), in_window


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
            if TMA:
                k, v, in_window = _page_kv(KP, VP, slots, p0, t, off_kvh, offs_m, offs_n, kpos0, window, stride_ps,
                                           stride_ph, stride_pn, PAGE_SIZE, BLOCK_N, HEAD_DIM, SLOTS)
                acc, l_i, m_i = _attn_fwd_tile(acc, l_i, m_i, q, tl.trans(k), v, in_window, qk_scale, WINDOWED,
                                               IN_PRECISION)
            else:
                slot = _pick(slots, t // tiles_per_page - p0, SLOTS).to(tl.int64)
                base, in_window, _ = _page_tile(slot, off_kvh, t, offs_m, offs_n, kpos0, window, stride_ps, stride_ph,
                                                stride_pn, PAGE_SIZE, BLOCK_N)
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
