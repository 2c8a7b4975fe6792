"""A prototype of the paged attention forward in Gluon (Triton's lower-level language), scheduled
as FlashAttention-3 does on Hopper, timed against the engine's Triton forward on the same pages
in the same run. Pages only (no chunk-own keys, no top-k or window), bf16, head_dim 128, pages of
128 keys: the shape where the schedule, not the features, is the question.

    python bench/gluon_forward.py --keys 16384,65536,262144      # Hopper GPU; rows to attention.jsonl

Why it exists: #3's backward target (0.8x cuDNN) needs a fused 5-product backward, which plain
Triton 3.6 serialises on Hopper (docs/benchmarks.md, session 18). Gluon (Triton 3.6's
`triton.experimental.gluon`) exposes what that kernel needs: a loader warp
(`gl.warp_specialize`) streaming K/V pages by TMA into a shared-memory ring guarded by mbarriers,
and consumer warpgroups issuing `warpgroup_mma(is_async=True)` with explicit
`warpgroup_mma_wait(num_outstanding=N)`. This forward is the first step on that route:

    loader warp:     Q; then per page tile t: wait `empty[t % STAGES]`, TMA K_t, V_t -> `ready[...]`
    compute (8 warps, 128 query rows): S_0, softmax_0; per tile j:
        issue S_{j+1} = Q K_{j+1}^T; O *= alpha_j; issue O += P_j V_j
        wait(1): S_{j+1} done   -> softmax_{j+1} on the CUDA cores while the tensor cores run P_j V_j
        wait(0): P_j V_j done   -> release tile j's stage

Every wait retires products issued in its own iteration. A loop that keeps a product in flight
across its back edge and waits for it with N > 0 outstanding makes ptxas (12.8 and 12.9)
serialise every wgmma of the kernel ("C7514: wgmma.mma_async instructions are serialized due to
non wgmma instructions reading accumulator registers"), whatever the register pressure.

Not under TRITON_INTERPRET (Gluon kernels do not run in the interpreter): a GPU-only experiment.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

from oomb.attention import paged  # noqa: E402
from oomb.attention.paged_hopper import _descriptor  # noqa: E402
from oomb.memory.spec import LayerPages  # noqa: E402

BLOCK_M, PAGE_SIZE, HEAD_DIM, STAGES = 128, 128, 128, 3  # shared memory: Q 32 KiB + 3 x (K, V) 192 KiB


@gluon.jit
def _load_page(K, V, k_smem, v_smem, ready, Table, t, stage, off_kvh, n_kv, PAGE_SIZE: gl.constexpr):
    """Page t's K and V tiles of KV head off_kvh into `stage`, completing ready[stage]. K, V: tensor
    descriptors of the pools viewed as (n_slots * Hkv * P, D)."""
    row = (gl.load(Table + t) * n_kv + off_kvh) * PAGE_SIZE
    mbarrier.expect(ready.index(stage), 2 * K.block_type.nbytes)
    tma.async_copy_global_to_shared(K, [row, 0], ready.index(stage), k_smem.index(stage))
    tma.async_copy_global_to_shared(V, [row, 0], ready.index(stage), v_smem.index(stage))


@gluon.jit
def _loader(Q, K, V, q_smem, k_smem, v_smem, q_ready, ready, empty, Table, q_row, off_kvh, n_kv, n_pages,
            STAGES: gl.constexpr, PAGE_SIZE: gl.constexpr):
    mbarrier.expect(q_ready, Q.block_type.nbytes)
    tma.async_copy_global_to_shared(Q, [q_row, 0], q_ready, q_smem)
    for t in range(n_pages):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        _load_page(K, V, k_smem, v_smem, ready, Table, t, stage, off_kvh, n_kv, PAGE_SIZE)


@gluon.jit
def _softmax(s, m_i, l_i, j, n_pages, qk_scale):
    """Tile j's online-softmax step from its raw scores s (BLOCK_M, BLOCK_N) fp32, in log2 units
    (qk_scale = scale / ln 2); j = n_pages is the loop's phantom tile (P = 0, alpha = 1)."""
    qk = gl.where(j < n_pages, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    p = gl.exp2(qk - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _compute(q_smem, k_smem, v_smem, q_ready, ready, empty, n_pages, qk_scale, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, mma: gl.constexpr):
    """The consumer warpgroups: (o unnormalised, m, l) of BLOCK_M query rows over every page, in
    the wgmma accumulator layout `mma`."""
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma)
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero, use_acc=False)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, n_pages, qk_scale)
    for j in range(n_pages):
        nxt = gl.minimum(j + 1, n_pages - 1)  # the last iteration recomputes its own tile: a phantom
        mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), zero, use_acc=False,
                               is_async=True)
        acc = acc * alpha[:, None]
        pv = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_operand), v_smem.index(j % STAGES), acc,
                           is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j + 1, n_pages, qk_scale)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
        mbarrier.arrive(empty.index(j % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _gluon_fwd(Q, K, V, Table, O, LSE, n_pages, C, H, n_kv, stride_tb, qk_scale, STAGES: gl.constexpr,
               num_warps: gl.constexpr):
    """One program per (query tile, b * H + head); Q a descriptor of (B * H * C, D) in (BLOCK_M, D)
    blocks, K and V of the pools in (PAGE_SIZE, D) blocks; O (B, H, C, D) fp32, LSE (B, H, C) base 2."""
    BLOCK_M: gl.constexpr = Q.block_type.shape[0]
    HEAD_DIM: gl.constexpr = Q.block_type.shape[1]
    BLOCK_N: gl.constexpr = K.block_type.shape[0]
    start_m = gl.program_id(0)
    off_bh = gl.program_id(1)
    off_kvh = (off_bh % H) // (H // n_kv)
    q_row = off_bh * C + start_m * BLOCK_M

    q_smem = gl.allocate_shared_memory(Q.dtype, Q.block_type.shape, Q.layout)
    k_smem = gl.allocate_shared_memory(K.dtype, [STAGES] + K.block_type.shape, K.layout)
    v_smem = gl.allocate_shared_memory(V.dtype, [STAGES] + V.block_type.shape, V.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BLOCK_N, 16])
    acc, m_i, l_i = gl.warp_specialize(
        [(_compute, (q_smem, k_smem, v_smem, q_ready, ready, empty, n_pages, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                     STAGES, mma)),
         (_loader, (Q, K, V, q_smem, k_smem, v_smem, q_ready, ready, empty, Table + (off_bh // H) * stride_tb,
                    q_row, off_kvh, n_kv, n_pages, STAGES, BLOCK_N))],
        [1], [40])  # the loader: one warp, 40 registers; the rest go to the compute warps

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    gl.store(O + (off_bh * C + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None])
    gl.store(LSE + off_bh * C + offs_m, m_i + gl.log2(l_i))


def gluon_forward(q: torch.Tensor, pages: LayerPages, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o fp32 (B, H, C, D) and the base-2 LSE (B, H, C) of q (B, H, C, D) bf16 over every page."""
    b, h, c, d = q.shape
    n_slots, n_kv, page_size, _ = pages.k.shape
    if (d, page_size, q.dtype) != (HEAD_DIM, PAGE_SIZE, torch.bfloat16) or c % BLOCK_M:
        raise ValueError(f"the prototype takes bf16, head_dim {HEAD_DIM}, pages of {PAGE_SIZE} and a chunk of a "
                         f"multiple of {BLOCK_M}; got {q.dtype}, {d}, {page_size}, {c}")
    q = q.contiguous()  # (B * H * C, D) rows for the descriptor
    o = torch.empty((b, h, c, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((b, h, c), device=q.device, dtype=torch.float32)
    qd, kd, vd = (_descriptor(x, rows, gl.bfloat16) for x, rows in ((q, BLOCK_M), (pages.k, PAGE_SIZE),
                                                                    (pages.v, PAGE_SIZE)))
    _gluon_fwd[(c // BLOCK_M, b * h)](qd, kd, vd, pages.table, o, lse, pages.n_pages, c, h, n_kv, pages.table.stride(0),
                                      scale / math.log(2.0), STAGES, num_warps=8)
    return o, lse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="16384,65536,262144", help="comma-separated earlier-key counts")
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention.jsonl"))
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("gluon_forward.py needs a Hopper GPU (sm_90)")
    torch.manual_seed(0)
    dev, dt, heads, n_kv, c = "cuda", torch.bfloat16, 28, 4, args.queries
    info = run_info()
    for n_keys in (int(n) for n in args.keys.split(",")):
        n_pages = n_keys // PAGE_SIZE
        kp = torch.randn(n_pages + 3, n_kv, PAGE_SIZE, HEAD_DIM, device=dev, dtype=dt)  # (n_slots, Hkv, P, D)
        vp = torch.randn_like(kp)
        table = torch.randperm(n_pages + 3, device=dev)[:n_pages].to(torch.int32)[None].contiguous()  # (1, n_pages)
        pages = LayerPages(kp, vp, None, None, table)
        q = torch.randn(1, heads, c, HEAD_DIM, device=dev, dtype=dt)
        own = torch.zeros(1, n_kv, c, HEAD_DIM, device=dev, dtype=dt)  # unused: include_self=False
        scale = HEAD_DIM ** -0.5

        def triton_fwd():
            return paged._forward(q, own, own, pages, scale, include_self=False, o_dtype=torch.float32)

        (o_ref, lse_ref), (o, lse) = triton_fwd(), gluon_forward(q, pages, scale)
        err_o, err_lse = (o - o_ref).abs().max().item(), (lse - lse_ref).abs().max().item()
        if not (err_o < 1e-3 and err_lse < 1e-4):  # both fp32 accumulations of the same bf16 products
            sys.exit(f"gluon forward disagrees with the engine's kernel at {n_keys} keys: max |o| error {err_o:.3g}, "
                     f"max |lse| error {err_lse:.3g}")
        flops = 4 * heads * c * n_keys * HEAD_DIM  # QK^T and PV, 2 FLOPs a multiply-add
        for impl, fn in (("paged (pages only)", triton_fwd), ("gluon-fwd prototype (pages only)",
                                                               lambda: gluon_forward(q, pages, scale))):
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            record(args.out, dict(N=n_keys, C=c, H=heads, Hkv=n_kv, D=HEAD_DIM, page_size=PAGE_SIZE, dtype="bf16",
                                  impl=impl, fwd_ms=round(ms, 3), bwd_ms=None,
                                  fwd_tflops=round(flops / ms / 1e9, 1), bwd_tflops=None,
                                  max_err_o=err_o, max_err_lse=err_lse, **info))


if __name__ == "__main__":
    main()
