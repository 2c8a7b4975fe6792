"""The backward over earlier pages on Hopper GPUs, in Gluon: dK/dV of the pages and their share of
dQ in one kernel, five tile products per (query tile, page tile) where the Triton path
(paged_backward.py: a dK/dV kernel and a dQ kernel) runs seven. paged._backward takes it where
`eligible` holds (dense pages with gradients, 16-bit, head_dim 128, a sm_90 GPU) and leaves the
chunk's own keys, and everything else, to the Triton kernels.

Why Gluon (Triton's lower-level language, `triton.experimental.gluon`): the fused loop is fast
only with FlashAttention-3's schedule, which Triton 3.6 compiles for Blackwell only; Gluon spells
it out (H200, 2026-11-30 and 2026-12-01, 5ae6a55 and df2c188; docs/experiments.md). One program per (page tile of 128 keys, b * KV
head) keeps its K, V in shared memory and dK, dV in registers, and loops over the query tiles of
the G query heads of its group:

    loader warp:   K, V once; per query tile i: wait `empty[i % 2]`, TMA Q_i, dO_i -> `ready[...]`
    compute (8 warps: two warpgroups of 64 keys), per query tile i:
        issue S^T = K Q^T, dP^T = V dO^T; wait(1)
        P^T = exp2(S^T - LSE)                      (the tensor cores run dP^T)
        issue dV += P^T dO; wait(1)
        dS^T = P^T (dP^T - delta)                  (the tensor cores run dV)
        dS^T -> shared memory; barrier; issue dQ_i = dS K, dK += dS^T Q; wait(1)
        dQ_i as int32 fixed point -> shared memory -> `dq_full[...]`   (the tensor cores run dK)
        wait(0); release the stage
    dQ warp:       per i: wait `dq_full`, TMA reduce-add the tile into the int32 dQ, `dq_empty`

Every wait retires products issued in its own iteration: a loop that keeps a product in flight
across its back edge makes ptxas 12.8/12.9 serialise every wgmma of the kernel (C7514).

dQ without float atomics: many programs add into one dQ tile, in no fixed order, and float sums
depend on the order. Integer sums do not, so each share is added as round(dQ_r * 2^e_r) with
e_r = 29 - ceil(log2 B_r), where B_r = scale * max|K| * (|dO_r| * max|V_j| + |delta_r|) bounds every
partial sum of row r over page keys (|dQ_rd| <= scale * sum_j |dS_rj| |K_jd|, |dS_rj| <= P_rj
(|dO_r| |V_j| + |delta_r|), and a row's page probabilities sum to <= 1): the total stays below
2^30 in magnitude, and dQ is the same bits run to run. max|K| and max|V| are a KV head's over the
call's pages (`_page_bounds`).

Not under TRITON_INTERPRET (Gluon kernels do not run in the interpreter): the GPU tests
(`pytest -m gpu tests/test_attention_hopper.py`) check it against the float64 oracle, and CPU tests
its page bounds and the fixed-point scheme.
"""
from __future__ import annotations

import inspect
import math

import torch
import triton
import triton.language as tl

from ..memory.spec import LayerPages

BLOCK_M, BLOCK_N, HEAD_DIM, STAGES = 64, 128, 128, 2
# shared memory: K, V 64 KiB; 2 x (Q, dO) 64 KiB; 2 x dS^T 32 KiB; 2 x int32 dQ 64 KiB (224.3 KiB in all)
FIXED_POINT_BITS = 29
# KernelOptions(gluon=False) (OOMB_GLUON=0) turns the kernel off: the Triton path everywhere (A/B runs).

# Gluon's API is experimental and moves between releases: the kernel looks up what it uses by
# feature, under each release's name (3.6's where 3.6 has one), and runs where all of it exists;
# any other Triton takes the Triton path. Run on the H200 with 3.6; compiled for sm_90 with 3.6 to 3.9
# (bench/kernel_ir.py, the same IR and instructions; tests/test_kernel_ir.py with the Triton installed).
AVAILABLE = False
try:
    from triton._C.libtriton import ir
    from triton._C.libtriton.gluon_ir import GluonOpBuilder
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Gluon (Triton < 3.5), or its Hopper modules elsewhere
    gl = None
if gl is not None:
    # 3.6: thread_barrier; 3.7 on: barrier (cluster=False: the same CTA-wide bar.sync).
    _thread_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier", None)
    # 3.6, 3.7: async_copy_global_to_shared; 3.8 on: async_load (3.9 keeps the old name, as an error).
    _tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared", None)
    # 3.8 on: async_atomic_add; 3.6, 3.7 have the op without a wrapper (the builtin below).
    _tma_reduce_add = getattr(tma, "async_atomic_add", None)
    AVAILABLE = (_thread_barrier is not None and _tma_load is not None
                 and (_tma_reduce_add is not None or hasattr(GluonOpBuilder, "create_async_tma_reduce"))
                 and "functions_and_args" in inspect.signature(gl.warp_specialize).parameters)  # 3.6's form


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on `device`: a Hopper GPU (sm_90), with a Triton that has the Gluon
    features it uses (AVAILABLE). Which calls take it is then `eligible`'s question."""
    return AVAILABLE and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def eligible(q: torch.Tensor, pages: LayerPages) -> bool:
    """Whether paged._backward runs the pages' backward here: dense pages with fp32 gradient pools
    (bf16 dK/dV pages take the Triton path), on a Hopper GPU, 16-bit, head_dim 128, a chunk of a
    multiple of 64 queries, pages of a multiple of 128 keys in contiguous pools (and a page table
    whose rows are contiguous, as the store's are). Not packed documents: this kernel has no
    document mask, so their pages' backward runs in paged.py's Triton kernels."""
    return (runs_on(q.device)
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == HEAD_DIM
            and q.shape[2] % BLOCK_M == 0 and pages.n_pages > 0 and pages.dk is not None
            and pages.selection is None and not pages.window and pages.key_start is None
            and pages.k.shape[2] % BLOCK_N == 0
            and pages.dk.dtype == torch.float32 and pages.dv.dtype == torch.float32 and pages.table.stride(-1) == 1
            and all(x.is_contiguous() for x in (pages.k, pages.v, pages.dk, pages.dv)))


@triton.jit
def _page_bounds(KP, VP, Table, Out, stride_ps, stride_ph, stride_pn, stride_tb, stride_tp, n_pages, HKV, D,
                 PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """max |K| and max_j |V_j| (row norms) of one page of one KV head: Out (B * Hkv, n_pages, 2)."""
    page = tl.program_id(0)
    off_bkv = tl.program_id(1)
    slot = tl.load(Table + (off_bkv // HKV) * stride_tb + page * stride_tp).to(tl.int64)
    offs_n = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    offs = slot * stride_ps + (off_bkv % HKV) * stride_ph + offs_n[:, None] * stride_pn + offs_d[None, :]
    mask = (offs_d < D)[None, :]
    k = tl.load(KP + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(VP + offs, mask=mask, other=0.0).to(tl.float32)
    out = Out + (off_bkv * n_pages + page) * 2
    tl.store(out, tl.max(tl.max(tl.abs(k), 1), 0))
    tl.store(out + 1, tl.sqrt(tl.max(tl.sum(v * v, 1), 0)))


def page_bounds(pages: LayerPages) -> torch.Tensor:
    """(B, Hkv, 2) fp32: max |K| and the largest row norm |V_j| over the table's pages, per KV head."""
    n_slots, n_kv, page_size, d = pages.k.shape
    b, n_pages = pages.table.shape
    out = torch.empty((b * n_kv, n_pages, 2), dtype=torch.float32, device=pages.k.device)
    if n_pages:
        _page_bounds[(n_pages, b * n_kv)](pages.k, pages.v, pages.table, out, *pages.k.stride()[:3],
                                          *pages.table.stride(), n_pages, n_kv, d, PAGE_SIZE=page_size,
                                          HEAD_DIM=triton.next_power_of_2(d), num_warps=8)
    return out.amax(1).view(b, n_kv, 2) if n_pages else out.new_zeros((b, n_kv, 2))


def dq_exponents(do: torch.Tensor, delta: torch.Tensor, bounds: torch.Tensor, scale: float) -> torch.Tensor:
    """e_r (B, H, C) fp32 of the fixed-point dQ (module docstring): a share of row r is added as
    round(dQ_r * 2^e_r). Rows with nothing to add (B_r = 0) get the largest exponent used, 100."""
    group = do.shape[1] // bounds.shape[1]
    k_max, v_max = bounds.repeat_interleave(group, dim=1).unbind(-1)  # (B, H) each
    do_norm = torch.linalg.vector_norm(do, dim=-1, dtype=torch.float32)  # (B, H, C)
    bound = scale * k_max[..., None] * (do_norm * v_max[..., None] + delta.abs())
    return (FIXED_POINT_BITS - torch.ceil(torch.log2(bound))).clamp(max=100.0)


def backward_pages(do, q, lse, delta, pages: LayerPages, scale: float) -> torch.Tensor:
    """dQ (B, H, C, D) fp32 of q over the pages; adds the pages' dK/dV into pages.dk / pages.dv.
    lse base 2 and delta (B, H, C) fp32 as paged._backward has them; requires eligible(q, pages)."""
    b, h, c, d = q.shape
    n_kv, page_size = pages.k.shape[1], pages.k.shape[2]
    q, do = q.contiguous(), do.contiguous()  # (B * H * C, D) rows for the descriptors
    fac = torch.exp2(dq_exponents(do, delta, page_bounds(pages), scale))  # 2^e_r (B, H, C)
    dqi = torch.zeros((b, h, c, d), dtype=torch.int32, device=q.device)
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    _fused_bwd[(pages.n_pages * (page_size // BLOCK_N), b * n_kv)](
        _descriptor(q, BLOCK_M, dtype), _descriptor(do, BLOCK_M, dtype), _descriptor(pages.k, BLOCK_N, dtype),
        _descriptor(pages.v, BLOCK_N, dtype), _descriptor(dqi, BLOCK_M, gl.int32), lse, delta,
        fac * scale, pages.table, pages.dk, pages.dv, c, h, n_kv, pages.table.stride(0),
        scale * (1.0 / math.log(2.0)), scale, GROUP=h // n_kv, PAGE_SIZE=page_size, STAGES=STAGES, num_warps=8)
    return dqi.float().div_(fac[..., None])  # exact: fac is a power of two


def _descriptor(x: torch.Tensor, rows: int, dtype) -> "TensorDescriptor":
    """x (..., D) contiguous as one (rows of all heads, D) descriptor of (rows, D) blocks."""
    d = x.shape[-1]
    x = x.view(-1, d)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, d],
                            gl.NVMMASharedLayout.get_default_for([rows, d], dtype))


if AVAILABLE:
    if _tma_reduce_add is None:
        @builtin
        def _tma_reduce_add(desc, coord, src, _semantic=None):
            """TMA reduce-add of the shared-memory tile `src` into `desc` at `coord`
            (cp.reduce.async.bulk.tensor), as 3.8's tma.async_atomic_add. Its source is read once
            tma.store_wait says so."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)

    @gluon.jit
    def _rint(x):
        """Round to the nearest int32 (ties to even)."""
        return gl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _loader(Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, kv_row, row0, n_iter,
                STAGES: gl.constexpr, BLOCK_M: gl.constexpr):
        mbarrier.expect(kv_ready, 2 * K.block_type.nbytes)
        _tma_load(K, [kv_row, 0], kv_ready, k_smem)
        _tma_load(V, [kv_row, 0], kv_ready, v_smem)
        for i in range(n_iter):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
            mbarrier.expect(ready.index(stage), 2 * Q.block_type.nbytes)
            _tma_load(Q, [row0 + i * BLOCK_M, 0], ready.index(stage), q_smem.index(stage))
            _tma_load(DO, [row0 + i * BLOCK_M, 0], ready.index(stage), do_smem.index(stage))

    @gluon.jit
    def _dq_writer(DQI, dq_smem, dq_full, dq_empty, row0, n_iter, BLOCK_M: gl.constexpr):
        for i in range(n_iter):
            buf = i % 2
            mbarrier.wait(dq_full.index(buf), (i // 2) & 1)
            _tma_reduce_add(DQI, [row0 + i * BLOCK_M, 0], dq_smem.index(buf))
            tma.store_wait(0)  # the tile read out of shared memory
            mbarrier.arrive(dq_empty.index(buf), count=1)

    @gluon.jit
    def _compute(q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, ready, empty, dq_full, dq_empty,
                 LSE, Delta, Fac, row0, n_iter, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, mma_s: gl.constexpr, mma_kv: gl.constexpr,
                 mma_q: gl.constexpr):
        """The consumer warpgroups: (dK unscaled, dV) of the page tile over every query tile;
        each tile's dQ share to the dQ warp through dq_smem. Query tile i is rows row0 + i * BLOCK_M
        of (B * H * C, D): the group's heads are consecutive, C a multiple of BLOCK_M."""
        dtype: gl.constexpr = q_smem.dtype
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_kv, k_width=2)
        offs_c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_s))
        offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_q))
        zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
        zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_q)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_kv)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_kv)
        lse = gl.load(LSE + row0 + offs_c)
        delta = gl.load(Delta + row0 + offs_c)
        fac = gl.load(Fac + row0 + offs_r)
        mbarrier.wait(kv_ready, 0)
        for i in range(n_iter):
            stage = i % STAGES
            buf = i % 2
            # The next tile's LSE, delta and dQ factors load a phase ahead of their use (loaded
            # where they are used, the kernel took 15 % longer at 64K keys: H200, 2026-12-01, a28a565).
            next_row = row0 + gl.minimum(i + 1, n_iter - 1) * BLOCK_M
            q_s = q_smem.index(stage)
            do_s = do_smem.index(stage)
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT, ))
            pT = gl.exp2(sT * qk_scale - lse[None, :])
            dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), a_op), do_s, dv, is_async=True)
            dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))
            dsT = (pT * (dpT - delta[None, :])).to(dtype)
            lse = gl.load(LSE + next_row + offs_c)
            delta = gl.load(Delta + next_row + offs_c)
            ds_s = ds_smem.index(buf)
            ds_s.store(dsT)
            fence_async_shared()
            _thread_barrier()  # both warpgroups' dS^T rows in shared memory before dQ's product reads them
            # dQ's product before dK's: its conversion and hand-off run while dK's runs (7 % at 64K keys).
            dq = warpgroup_mma(ds_s.permute((1, 0)), k_smem, zero_q, use_acc=False, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(dsT, a_op), q_s, dk, is_async=True)
            dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))
            dqi = _rint(dq * fac[:, None])
            fac = gl.load(Fac + next_row + offs_r)
            mbarrier.wait(dq_empty.index(buf), ((i // 2) & 1) ^ 1)
            dq_smem.index(buf).store(dqi)
            fence_async_shared()
            _thread_barrier()
            mbarrier.arrive(dq_full.index(buf), count=1)
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
            _thread_barrier()  # both warpgroups done reading the stage
            mbarrier.arrive(empty.index(stage), count=1)
        return dk, dv

    @gluon.jit
    def _fused_bwd(Q, DO, K, V, DQI, LSE, Delta, Fac, Table, DKP, DVP, C, H, n_kv, stride_tb, qk_scale, scale,
                   GROUP: gl.constexpr, PAGE_SIZE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """One program per (page tile, b * Hkv + KV head). Q, DO: descriptors of (B * H * C, D) in
        (BLOCK_M, D) blocks; K, V of the pools (n_slots * Hkv * P, D) in (BLOCK_N, D) blocks; DQI of
        the int32 dQ (B * H * C, D); LSE (base 2), Delta, Fac = scale * 2^e (B, H, C) fp32; DKP, DVP
        the fp32 gradient pools, read-modify-written (one writer per element: no atomics)."""
        BLOCK_M: gl.constexpr = Q.block_type.shape[0]
        HEAD_DIM: gl.constexpr = Q.block_type.shape[1]
        BLOCK_N: gl.constexpr = K.block_type.shape[0]
        TILES: gl.constexpr = PAGE_SIZE // BLOCK_N
        page = gl.program_id(0) // TILES
        off_bkv = gl.program_id(1)
        off_b = off_bkv // n_kv
        off_kvh = off_bkv % n_kv
        slot = gl.load(Table + off_b * stride_tb + page)
        kv_row = (slot * n_kv + off_kvh) * PAGE_SIZE + (gl.program_id(0) % TILES) * BLOCK_N
        row0 = (off_b * H + off_kvh * GROUP) * C
        n_iter = GROUP * (C // BLOCK_M)

        q_smem = gl.allocate_shared_memory(Q.dtype, [STAGES] + Q.block_type.shape, Q.layout)
        do_smem = gl.allocate_shared_memory(DO.dtype, [STAGES] + DO.block_type.shape, DO.layout)
        k_smem = gl.allocate_shared_memory(K.dtype, K.block_type.shape, K.layout)
        v_smem = gl.allocate_shared_memory(V.dtype, V.block_type.shape, V.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], Q.dtype)
        ds_smem = gl.allocate_shared_memory(Q.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.int32, [2] + DQI.block_type.shape, DQI.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_ready, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(dq_full.index(s), count=1)
            mbarrier.init(dq_empty.index(s), count=1)

        # Accumulator layouts: S^T, dP^T (BLOCK_N, BLOCK_M) and dK, dV (BLOCK_N, HEAD_DIM) split by
        # keys over the two warpgroups; dQ (BLOCK_M, HEAD_DIM) by columns.
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
        mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, HEAD_DIM, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                         instr_shape=[16, HEAD_DIM // (num_warps // 4), 16])
        dk, dv = gl.warp_specialize(
            [(_compute, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, ready, empty, dq_full,
                         dq_empty, LSE, Delta, Fac, row0, n_iter, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                         mma_s, mma_kv, mma_q)),
             (_loader, (Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, kv_row, row0, n_iter,
                        STAGES, BLOCK_M)),
             (_dq_writer, (DQI, dq_smem, dq_full, dq_empty, row0, n_iter, BLOCK_M))],
            [1, 1], [40, 40])  # the loader and the dQ warp: one warp, 40 registers each

        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_kv))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_kv))
        g_offs = (kv_row.to(gl.int64) + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        gl.store(DKP + g_offs, gl.load(DKP + g_offs) + dk * scale)  # dK = scale * dS^T Q
        gl.store(DVP + g_offs, gl.load(DVP + g_offs) + dv)
