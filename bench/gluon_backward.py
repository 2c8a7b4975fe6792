"""A prototype of the paged attention backward in Gluon: dK/dV of the earlier pages and dQ in one
kernel (the five tile products of FlashAttention's backward, where the engine's two Triton
kernels run seven), timed against the engine's backward over the same pages in the same run.
Pages only (no chunk-own keys, no top-k or window), bf16, head_dim 128, pages of 128 keys.

    python bench/gluon_backward.py --keys 16384,65536      # Hopper GPU; rows to attention.jsonl
    python bench/gluon_backward.py --offline               # no GPU: compile for sm_90, ptxas's registers and spills

Why: #3's backward target (0.8x cuDNN) needs the 5-product backward, which plain Triton 3.6
serialises on Hopper (docs/benchmarks.md, session 18). One program per (page, KV head) keeps its
page's K, V in shared memory and dK, dV in registers, and loops over the query tiles of the G
query heads of its group:

    loader warp:     K, V once; per query tile i: wait `empty[i % 2]`, TMA Q_i, dO_i -> `ready[...]`
    compute (8 warps, two warpgroups of 64 keys each), per query tile i:
        issue S^T = K Q^T, dP^T = V dO^T; wait(1)
        P^T = exp2(S^T - LSE)                        (the tensor cores run dP^T)
        issue dV += P^T dO; wait(1)
        dS^T = P^T (dP^T - delta)                    (the tensor cores run dV)
        dS^T -> shared memory; issue dK += dS^T Q; barrier; issue dQ_i = dS K; wait(0)
        dQ_i as int32 fixed point -> shared memory   -> `dq_full[...]`
    dQ warp:         per i: wait `dq_full`, TMA reduce-add the tile into the int32 dQ, `dq_empty`

Many programs add into one dQ tile, in no fixed order; integer addition does not depend on the
order, so dQ is the same bits run to run (session 18's scheme): the tile of query row r is added
as round(dQ_r * 2^e_r) with e_r = 29 - ceil(log2 B_r), where B_r = scale max|K| (|dO_r| max|V| +
|delta_r|) bounds every partial sum over page keys (the page probabilities of a row sum to <= 1),
so the sum of all shares stays below 2^30 in magnitude.

Not under TRITON_INTERPRET (Gluon kernels do not run in the interpreter): a GPU-only experiment.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
from torch.nn.attention import SDPBackend
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from bench_attention import bench_sdpa  # noqa: E402
from common import record, run_info  # noqa: E402

from oomb.attention import paged  # noqa: E402
from oomb.memory.spec import LayerPages  # noqa: E402

BLOCK_M, PAGE_SIZE, HEAD_DIM, STAGES = 64, 128, 128, 2
# shared memory: K, V 64 KiB; 2 x (Q, dO) 64 KiB; 2 x dS^T 32 KiB; 2 x int32 dQ 64 KiB
FIXED_POINT_BITS = 29


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared-memory tile `src` into `desc` at `coord` (cp.reduce.async.bulk.tensor);
    Gluon 3.6 has the op but no Python wrapper. Complete (its source read) after tma.store_wait."""
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
    tma.async_copy_global_to_shared(K, [kv_row, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(V, [kv_row, 0], kv_ready, v_smem)
    for i in range(n_iter):
        stage = i % STAGES
        row = row0 + i * BLOCK_M
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(stage), 2 * Q.block_type.nbytes)
        tma.async_copy_global_to_shared(Q, [row, 0], ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(DO, [row, 0], ready.index(stage), do_smem.index(stage))


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
    """The consumer warpgroups: (dK unscaled, dV) of the page over every query tile; each tile's
    dQ share to the dQ warp through dq_smem."""
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_kv, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, mma_s)
    rows_q: gl.constexpr = gl.SliceLayout(1, mma_q)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_s)
    zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, mma_q)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_kv)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, mma_kv)
    offs_c = gl.arange(0, BLOCK_M, layout=cols)
    offs_r = gl.arange(0, BLOCK_M, layout=rows_q)
    lse = gl.load(LSE + row0 + offs_c)
    delta = gl.load(Delta + row0 + offs_c)
    fac = gl.load(Fac + row0 + offs_r)
    mbarrier.wait(kv_ready, 0)
    for i in range(n_iter):
        stage = i % STAGES
        buf = i % 2
        # The next tile's rows (LSE, delta, dQ factors) load a phase ahead of their use.
        next_row = row0 + gl.minimum(i + 1, n_iter - 1) * BLOCK_M
        q_s = q_smem.index(stage)
        do_s = do_smem.index(stage)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        sT = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT, ))
        pT = gl.exp2(sT * qk_scale - lse[None, :])
        dv = warpgroup_mma(gl.convert_layout(pT.to(gl.bfloat16), a_op), do_s, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))
        dsT = (pT * (dpT - delta[None, :])).to(gl.bfloat16)
        lse = gl.load(LSE + next_row + offs_c)
        delta = gl.load(Delta + next_row + offs_c)
        ds_s = ds_smem.index(buf)
        ds_s.store(dsT)
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups' dS^T rows in shared memory before dQ's product reads them
        # dQ's product before dK's: its fixed-point conversion and hand-off run while dK's runs.
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_smem, zero_q, use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dsT, a_op), q_s, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))
        dqi = _rint(dq * fac[:, None])
        fac = gl.load(Fac + next_row + offs_r)
        mbarrier.wait(dq_empty.index(buf), ((i // 2) & 1) ^ 1)
        dq_smem.index(buf).store(dqi)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(dq_full.index(buf), count=1)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
        gl.thread_barrier()  # both warpgroups done reading the stage
        mbarrier.arrive(empty.index(stage), count=1)
    return dk, dv


@gluon.jit
def _gluon_bwd(Q, DO, K, V, DQI, LSE, Delta, Fac, Table, DKP, DVP, C, H, n_kv, n_pages, stride_tb, qk_scale, scale,
               GROUP: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """One program per (page, b * Hkv + KV head), the page's slot the fastest axis... see module doc.
    Q, DO: descriptors of (B * H * C, D) in (BLOCK_M, D) blocks; K, V of the pools in (PAGE_SIZE, D)
    blocks; DQI of the int32 dQ (B * H * C, D); LSE (base 2), Delta, Fac (B, H, C) fp32; DKP, DVP the
    fp32 gradient pools (n_slots, Hkv, P, D), read-modify-written."""
    BLOCK_M: gl.constexpr = Q.block_type.shape[0]
    HEAD_DIM: gl.constexpr = Q.block_type.shape[1]
    BLOCK_N: gl.constexpr = K.block_type.shape[0]
    page = gl.program_id(0)
    off_bkv = gl.program_id(1)
    off_b = off_bkv // n_kv
    off_kvh = off_bkv % n_kv
    slot = gl.load(Table + off_b * stride_tb + page)
    kv_row = (slot * n_kv + off_kvh) * BLOCK_N
    row0 = (off_b * H + off_kvh * GROUP) * C  # the group's query heads, consecutive rows of (B * H * C, D)
    n_iter = GROUP * (C // BLOCK_M)

    q_smem = gl.allocate_shared_memory(Q.dtype, [STAGES] + Q.block_type.shape, Q.layout)
    do_smem = gl.allocate_shared_memory(DO.dtype, [STAGES] + DO.block_type.shape, DO.layout)
    k_smem = gl.allocate_shared_memory(K.dtype, K.block_type.shape, K.layout)
    v_smem = gl.allocate_shared_memory(V.dtype, V.block_type.shape, V.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_M], ds_layout)
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

    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_M, 16])
    mma_kv: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, HEAD_DIM, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                     instr_shape=[16, HEAD_DIM // (num_warps // 4), 16])
    dk, dv = gl.warp_specialize(
        [(_compute, (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, ready, empty, dq_full, dq_empty,
                     LSE, Delta, Fac, row0, n_iter, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, mma_s, mma_kv,
                     mma_q)),
         (_loader, (Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, kv_row, row0, n_iter,
                    STAGES, BLOCK_M)),
         (_dq_writer, (DQI, dq_smem, dq_full, dq_empty, row0, n_iter, BLOCK_M))],
        [1, 1], [40, 40])

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_kv))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_kv))
    g_offs = (kv_row + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
    gl.store(DKP + g_offs, gl.load(DKP + g_offs) + dk * scale)
    gl.store(DVP + g_offs, gl.load(DVP + g_offs) + dv)


def _desc(x: torch.Tensor, rows: int, dtype) -> TensorDescriptor:
    d = x.shape[-1]
    x = x.reshape(-1, d)  # (rows of all heads, D): one 2-D descriptor
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, d], layout)


def dq_factor(do: torch.Tensor, delta: torch.Tensor, pages: LayerPages, scale: float) -> torch.Tensor:
    """2^e_r (B, H, C) fp32, e_r = 29 - ceil(log2 B_r): see the module doc. (The engine would take
    max|K| and max|V| per page as the pages are written; here from the pools.)"""
    kv = pages.table.flatten().long()
    k_max = pages.k[kv].abs().amax().float()
    v_norm = pages.v[kv].float().norm(dim=-1).amax()
    bound = scale * k_max * (do.float().norm(dim=-1) * v_norm + delta.abs())
    e = FIXED_POINT_BITS - torch.ceil(torch.log2(bound.clamp_min(1e-30)))
    return torch.exp2(e.clamp(max=100.0))


def gluon_backward(do, q, o, lse2, pages: LayerPages, scale: float) -> torch.Tensor:
    """dq fp32 (B, H, C, D) of q over every page; adds dK/dV into pages.dk / pages.dv. lse2: base 2."""
    b, h, c, d = q.shape
    n_slots, n_kv, page_size, _ = pages.k.shape
    if (d, page_size, q.dtype) != (HEAD_DIM, PAGE_SIZE, torch.bfloat16) or c % BLOCK_M:
        raise ValueError(f"the prototype takes bf16, head_dim {HEAD_DIM}, pages of {PAGE_SIZE} and a chunk of a "
                         f"multiple of {BLOCK_M}; got {q.dtype}, {d}, {page_size}, {c}")
    delta = (o.float() * do.float()).sum(-1)  # (B, H, C)
    fac = dq_factor(do, delta, pages, scale)
    dqi = torch.zeros((b, h, c, d), dtype=torch.int32, device=q.device)
    _gluon_bwd[(pages.n_pages, b * n_kv)](
        _desc(q, BLOCK_M, gl.bfloat16), _desc(do, BLOCK_M, gl.bfloat16), _desc(pages.k, PAGE_SIZE, gl.bfloat16),
        _desc(pages.v, PAGE_SIZE, gl.bfloat16), _desc(dqi, BLOCK_M, gl.int32), lse2, delta, fac * scale,
        pages.table, pages.dk, pages.dv, c, h, n_kv, pages.n_pages, pages.table.stride(0), scale / math.log(2.0),
        scale, h // n_kv, STAGES, num_warps=8)
    return dqi.float() / fac[..., None]


def offline() -> None:
    """Compile for sm_90 without a GPU; print ptxas's registers and spills per partition."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    def sig_desc(rows, dtype, tdtype):
        x = torch.empty((rows * 4, HEAD_DIM), dtype=tdtype)
        return mangle_type(_desc(x, rows, dtype))

    bf, i32 = sig_desc(BLOCK_M, gl.bfloat16, torch.bfloat16), sig_desc(BLOCK_M, gl.int32, torch.int32)
    kv = sig_desc(PAGE_SIZE, gl.bfloat16, torch.bfloat16)
    sig = dict(Q=bf, DO=bf, K=kv, V=kv, DQI=i32, LSE="*fp32", Delta="*fp32", Fac="*fp32", Table="*i32", DKP="*fp32",
               DVP="*fp32", C="i32", H="i32", n_kv="i32", n_pages="i32", stride_tb="i32", qk_scale="fp32",
               scale="fp32", GROUP="constexpr", STAGES="constexpr", num_warps="constexpr")
    names = list(sig)
    const = {(names.index("GROUP"), ): 7, (names.index("STAGES"), ): STAGES, (names.index("num_warps"), ): 8}
    k = triton.compile(GluonASTSource(_gluon_bwd, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8))
    print("shared memory", k.metadata.shared, "bytes")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if re.search(r"registers|spill|C7514|error", line):
            print(line.strip())
    if os.environ.get("GLUON_DUMP"):
        for ext in ("ttgir", "ptx"):
            with open(f"{os.environ['GLUON_DUMP']}.{ext}", "w") as f:
                f.write(k.asm[ext])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", default="16384,65536", help="comma-separated earlier-key counts")
    ap.add_argument("--queries", type=int, default=4096)
    ap.add_argument("--offline", action="store_true", help="compile for sm_90 on the CPU; no GPU needed")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "attention.jsonl"))
    args = ap.parse_args()
    if args.offline:
        return offline()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("gluon_backward.py needs a Hopper GPU (sm_90)")
    torch.manual_seed(0)
    dev, dt, heads, n_kv, c = "cuda", torch.bfloat16, 28, 4, args.queries
    info = run_info()
    for n_keys in (int(n) for n in args.keys.split(",")):
        n_pages = n_keys // PAGE_SIZE
        kp = torch.randn(n_pages + 3, n_kv, PAGE_SIZE, HEAD_DIM, device=dev, dtype=dt)  # (n_slots, Hkv, P, D)
        vp = torch.randn_like(kp)
        table = torch.randperm(n_pages + 3, device=dev)[:n_pages].to(torch.int32)[None].contiguous()  # (1, n_pages)
        dk_t, dv_t = torch.zeros(kp.shape, device=dev), torch.zeros(kp.shape, device=dev)
        dk_g, dv_g = torch.zeros_like(dk_t), torch.zeros_like(dv_t)
        q = torch.randn(1, heads, c, HEAD_DIM, device=dev, dtype=dt)
        do = torch.randn_like(q)
        own = torch.zeros(1, n_kv, c, HEAD_DIM, device=dev, dtype=dt)  # unused: include_self=False
        scale = HEAD_DIM ** -0.5
        o, lse2 = paged._forward(q, own, own, LayerPages(kp, vp, None, None, table), scale, include_self=False)
        pages_t, pages_g = LayerPages(kp, vp, dk_t, dv_t, table), LayerPages(kp, vp, dk_g, dv_g, table)

        def triton_bwd():
            return paged._backward(do, q, own, own, o, lse2, pages_t, scale, include_self=False,
                                   dq_dtype=torch.float32)[0]

        def gluon_bwd():
            return gluon_backward(do, q, o, lse2, pages_g, scale)

        dq_t, dq_g = triton_bwd(), gluon_bwd()
        errs = {f"max_err_{name}": ((a - ref).abs().max() / ref.abs().max()).item()
                for name, a, ref in (("dq", dq_g, dq_t), ("dk", dk_g, dk_t), ("dv", dv_g, dv_t))}
        same = torch.equal(dq_g, gluon_bwd())
        print(f"{n_keys} keys: max errors vs the engine's kernels (relative to the largest value) "
              f"{ {k: f'{v:.2e}' for k, v in errs.items()} }; dQ equal run to run: {same}", flush=True)
        if not (max(errs.values()) < 1e-2 and same):
            sys.exit(f"gluon backward disagrees with the engine's kernels at {n_keys} keys")
        flops = 10 * heads * c * n_keys * HEAD_DIM  # five products, 2 FLOPs a multiply-add
        cudnn = bench_sdpa(n_keys, c, SDPBackend.CUDNN_ATTENTION)["bwd_ms"]
        print(f"  sdpa_cudnn: {cudnn:.3f} ms, {flops / cudnn / 1e9:.1f} TFLOP/s", flush=True)
        for impl, fn in (("paged (pages only)", triton_bwd), ("gluon-bwd prototype (pages only)", gluon_bwd)):
            ms = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median")
            print(f"  {impl}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, {cudnn / ms:.3f}x cuDNN", flush=True)
            record(args.out, dict(N=n_keys, C=c, H=heads, Hkv=n_kv, D=HEAD_DIM, page_size=PAGE_SIZE, dtype="bf16",
                                  impl=impl, fwd_ms=None, bwd_ms=round(ms, 3), fwd_tflops=None,
                                  bwd_tflops=round(flops / ms / 1e9, 1), sdpa_cudnn_bwd_ms=round(cudnn, 3), **errs,
                                  **info))

if __name__ == "__main__":
    main()
