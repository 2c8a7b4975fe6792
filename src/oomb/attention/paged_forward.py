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
def _own_key_tiles(q_lo, window, ks_lo, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, PACKED: tl.constexpr):
    """Own-key tiles of a query tile starting at q_lo: [0, free_hi) need no mask, [masked_lo,
    diagonal end) do. A sliding window masks every tile from the first it can reach; packed
    documents every tile from the one holding ks_lo, the tile's first document start (relative
    to the chunk; the tiles before it hold finished documents, skipped)."""
    masked_lo = q_lo
    free_hi = q_lo
    if WINDOWED or PACKED:
        masked_lo = 0
        free_hi = 0
    if WINDOWED:
        masked_lo = (tl.maximum(q_lo - window + 1, 0) // BLOCK_N) * BLOCK_N
    if PACKED:
        masked_lo = tl.maximum(masked_lo, (tl.maximum(ks_lo, 0) // BLOCK_N) * BLOCK_N)
    return masked_lo, free_hi


@triton.jit
def _document_starts(KeyStart, off_b, q_start, offs_m, C, stride_ksb, PACKED: tl.constexpr):
    """(BLOCK_M,) int32: the first token of each query's document, relative to the chunk's start
    (negative: an earlier chunk); without packing a position before every key (no mask)."""
    if PACKED:
        # Rows past the chunk (padding): C, past every valid row's, so the tile's minimum is its first row's.
        ks = tl.load(KeyStart + off_b * stride_ksb + q_start + offs_m, mask=offs_m < C, other=q_start + C)
        return ks - q_start
    return tl.zeros_like(offs_m) - 2147483647


@triton.jit
def _first_page_tile(ks_lo, kpos0, BLOCK_N: tl.constexpr, PACKED: tl.constexpr):
    """The first page key tile (of a dense group) a query tile whose documents start at ks_lo or
    later reads: the tiles before it hold finished documents only, and are skipped."""
    t_lo = 0
    if PACKED:
        t_lo = tl.maximum(ks_lo - kpos0, 0) // BLOCK_N
    return t_lo


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
def _tile_start(p0, t_lo, tiles_per_page, PACKED: tl.constexpr):
    """The first page key tile to visit of the pages from p0: packed, not before t_lo
    (_first_page_tile)."""
    t0 = p0 * tiles_per_page
    if PACKED:
        t0 = tl.maximum(t0, t_lo)
    return t0


@triton.jit
def _page_pos(PagePos, Sel, sel_row, off_b, i, kpos0, stride_ppb, PAGE_SIZE: tl.constexpr,
              SPARSE: tl.constexpr, PACKED: tl.constexpr):
    """Position of the first key of the i-th page visited, relative to the chunk's start: pages
    follow one another from kpos0 (dense), or PagePos (B, n_pages) gives each selected page's
    (sparse, packed; unused otherwise: no window on a sparse layer)."""
    if SPARSE and PACKED:
        page = tl.load(Sel + sel_row + i)
        return tl.load(PagePos + off_b * stride_ppb + page)
    return kpos0 + i * PAGE_SIZE


@triton.jit
def _page_pos_batch(PagePos, Sel, sel_row, off_b, p0, p_hi, stride_ppb, SLOTS: tl.constexpr, SPARSE: tl.constexpr,
                    PACKED: tl.constexpr):
    """_page_pos of the visited pages p0 .. p0 + SLOTS - 1 as one register vector, loaded with
    their slots (_slot_batch: a load inside the tile loop would stall its pipeline); a dummy
    where the pages follow one another."""
    if SPARSE and PACKED:
        return _slot_batch(PagePos, Sel, sel_row, off_b, p0, p_hi, stride_ppb, 1, SLOTS, SPARSE)
    return tl.zeros([SLOTS], dtype=tl.int32)


@triton.jit
def _pick_page_pos(poss, p0, i, kpos0, PAGE_SIZE: tl.constexpr, SLOTS: tl.constexpr, SPARSE: tl.constexpr,
                   PACKED: tl.constexpr):
    """_page_pos of the i-th page visited, from _page_pos_batch's vector of the pages from p0."""
    if SPARSE and PACKED:
        return _pick(poss, i - p0, SLOTS)
    return kpos0 + i * PAGE_SIZE


@triton.jit
def _visible(kpos, offs_m, ks, window, WINDOWED: tl.constexpr, PACKED: tl.constexpr):
    """(BLOCK_M, BLOCK_N): which queries offs_m see which keys at kpos (positions relative to the
    chunk's start), by the sliding window and by document (ks: each query's document start)."""
    visible = kpos[None, :] >= ks[:, None]
    if WINDOWED:
        visible = visible & (kpos[None, :] > offs_m[:, None] - window)
    return visible


@triton.jit
def _page_tile(slot, off_kvh, t, offs_m, offs_n, page_pos, window, ks, stride_ps, stride_ph, stride_pn,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, PACKED: tl.constexpr):
    """The t-th page key tile a query tile visits, its page in pool slot `slot` with its first key
    at page_pos (relative to the chunk's start: negative for earlier pages): the offset of the
    tile's first key in the K/V pools, which (query, key) pairs the window and the documents let
    through, and its first key in the page (with the slot, a tensor-descriptor load's coordinates)."""
    tiles_per_page = PAGE_SIZE // BLOCK_N
    n0 = (t % tiles_per_page) * BLOCK_N
    base = slot * stride_ps + off_kvh * stride_ph + n0 * stride_pn
    return base, _visible(page_pos + n0 + offs_n, offs_m, ks, window, WINDOWED, PACKED), n0


@triton.jit
def _page_kv(KP, VP, slots, p0, t, off_kvh, offs_m, offs_n, page_pos, window, ks, stride_ps, stride_ph, stride_pn,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SLOTS: tl.constexpr,
             WINDOWED: tl.constexpr, PACKED: tl.constexpr):
    """The t-th page key tile through the pools' tensor descriptors KP, VP (block (1, 1, BLOCK_N,
    HEAD_DIM)), its page's slot picked from `slots` (_slot_batch of the pages from p0): k, v
    (BLOCK_N, HEAD_DIM) and which (query, key) pairs the window and the documents let through."""
    slot = _pick(slots, t // (PAGE_SIZE // BLOCK_N) - p0, SLOTS).to(tl.int64)
    _, visible, n0 = _page_tile(slot, off_kvh, t, offs_m, offs_n, page_pos, window, ks, stride_ps, stride_ph,
                                stride_pn, PAGE_SIZE, BLOCK_N, WINDOWED, PACKED)
    coords = [slot.to(tl.int32), off_kvh.to(tl.int32), n0, 0]
    return KP.load(coords).reshape(BLOCK_N, HEAD_DIM), VP.load(coords).reshape(BLOCK_N, HEAD_DIM), visible


@triton.jit
def _diagonal_visible(cols, offs_m, C, window, ks, WINDOWED: tl.constexpr, PACKED: tl.constexpr):
    """Own keys `cols` of a masked tile: which each query sees (causal j <= i, j < C, inside the
    window, in its document: j >= ks), and which are inside the chunk (keys past it are padding)."""
    in_chunk = cols < C
    visible = (cols[None, :] <= offs_m[:, None]) & in_chunk[None, :]
    if WINDOWED:
        visible = visible & (cols[None, :] > offs_m[:, None] - window)
    if PACKED:
        visible = visible & (cols[None, :] >= ks[:, None])
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
    Q, K, V, KP, VP, Table, Sel, Span, KeyStart, PagePos, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ps, stride_ph, stride_pn, stride_pd,  # KP and VP pools (same strides)
    stride_tb, stride_tp,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_ksb, stride_ppb,
    C, n_pages, qk_scale, H, n_blocks, max_sel, block_q, window, kpos0, q_start,
    GROUP: tl.constexpr, D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IN_PRECISION: tl.constexpr, INCLUDE_SELF: tl.constexpr,
    SPARSE: tl.constexpr, WINDOWED: tl.constexpr, TMA: tl.constexpr, SLOTS: tl.constexpr, PACKED: tl.constexpr,
):
    """TMA: KP and VP are tensor descriptors of the pools (block (1, 1, BLOCK_N, HEAD_DIM)), so
    page tiles load through the tensor memory accelerator (TMA); else pointers.

    PACKED: KeyStart (B, T) int32 holds each token's document start (attention/documents.py);
    a query sees only keys at or after its own (q_start: the chunk's first position). Page tiles
    before the query tile's first document start are skipped (dense), the others masked;
    PagePos (B, n_pages) int32 gives a sparse group's pages' first key relative to the chunk."""
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

    # Earlier pages: full, all before the chunk, so no mask but the head_dim one (and the
    # window's and the documents'). Per batch of SLOTS pages, one flat loop over (page, tile
    # within page) whose addresses come from registers, so the compiler pipelines it.
    tiles_per_page = PAGE_SIZE // BLOCK_N
    kT_mask = mask_d[:, None]
    v_mask = mask_d[None, :]
    ks = _document_starts(KeyStart, off_b, q_start, offs_m, C, stride_ksb, PACKED)  # (BLOCK_M,)
    ks_lo = tl.min(ks)  # the tile's first query's: document starts never decrease
    sel_row = ((off_b * (H // GROUP) + off_kvh) * n_blocks + (start_m * BLOCK_M) // block_q) * max_sel
    p_lo, p_hi = _page_range(Span, sel_row // max_sel, n_pages, SPARSE)
    t_lo = 0
    if not SPARSE:  # a top-k selection only holds pages of the query block's documents (sparse.py)
        t_lo = _first_page_tile(ks_lo, kpos0, BLOCK_N, PACKED)
        p_lo = tl.maximum(p_lo, t_lo // tiles_per_page)
    for p0 in range(p_lo, p_hi, SLOTS):
        slots = _slot_batch(Table, Sel, sel_row, off_b, p0, p_hi, stride_tb, stride_tp, SLOTS, SPARSE)
        poss = _page_pos_batch(PagePos, Sel, sel_row, off_b, p0, p_hi, stride_ppb, SLOTS, SPARSE, PACKED)
        for t in range(_tile_start(p0, t_lo, tiles_per_page, PACKED), tl.minimum(p0 + SLOTS, p_hi) * tiles_per_page):
            page_pos = _pick_page_pos(poss, p0, t // tiles_per_page, kpos0, PAGE_SIZE, SLOTS, SPARSE, PACKED)
            if TMA:
                k, v, visible = _page_kv(KP, VP, slots, p0, t, off_kvh, offs_m, offs_n, page_pos, window, ks,
                                         stride_ps, stride_ph, stride_pn, PAGE_SIZE, BLOCK_N, HEAD_DIM, SLOTS,
                                         WINDOWED, PACKED)
                acc, l_i, m_i = _attn_fwd_tile(acc, l_i, m_i, q, tl.trans(k), v, visible, qk_scale,
                                               WINDOWED or PACKED, IN_PRECISION)
            else:
                slot = _pick(slots, t // tiles_per_page - p0, SLOTS).to(tl.int64)
                base, visible, _ = _page_tile(slot, off_kvh, t, offs_m, offs_n, page_pos, window, ks, stride_ps,
                                              stride_ph, stride_pn, PAGE_SIZE, BLOCK_N, WINDOWED, PACKED)
                kT_ptrs = KP + base + offs_n[None, :] * stride_pn + offs_d[:, None] * stride_pd
                v_ptrs = VP + base + offs_n[:, None] * stride_pn + offs_d[None, :] * stride_pd
                acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_ptrs, v_ptrs, kT_mask, v_mask, visible,
                                                qk_scale, WINDOWED or PACKED, IN_PRECISION)

    # The chunk's own keys ride with the first group of pages only (attention/function.py).
    if INCLUDE_SELF:
        # Own keys before this query tile: all visible (and all < C), no mask. With a sliding
        # window every visited tile is masked instead, from the window's first tile on.
        k_base = K + off_b * stride_kb + off_kvh * stride_kh
        v_base = V + off_b * stride_vb + off_kvh * stride_vh
        masked_lo, free_hi = _own_key_tiles(start_m * BLOCK_M, window, ks_lo, BLOCK_N, WINDOWED, PACKED)
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
            visible, in_chunk = _diagonal_visible(cols, offs_m, C, window, ks, WINDOWED, PACKED)
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
