"""Compile the paged attention kernels for a Hopper GPU without one, and show how Triton's software
pipeliner treated each loop: whether a loop's loads stay in flight while it computes.

    python bench/kernel_ir.py                 # forward, dQ, dK/dV (pages; own keys); dense and top-k; H200
    python bench/kernel_ir.py --dump /tmp/ir  # also write each kernel's TTGIR there
    python bench/kernel_ir.py --kinds hopper  # paged_hopper's Gluon backward (where paged_hopper.AVAILABLE:
                                              # in the default set there)
    python bench/kernel_ir.py --packed        # the kernels' packed-documents variants (position_ids)

Each kernel is compiled for sm_90 (ptxas ships with Triton) with the launch settings the GPU
would use (`_fwd_config` / `_bwd_config`, bf16, head_dim 128, 28/4 heads, pages of 128) and strides
specialised as at launch (the head_dim stride 1, the others multiples of 16). In the TTGIR, a
pipelined loop waits at the top of an iteration for the copies of an earlier one and leaves the
newer ones in flight (`ttg.async_wait ... {num = N}`, N > 0); `num = 0` inside a loop means its
next tile is loaded only after its compute, with nothing overlapping: what a load in the address
chain (a page table, a selection) does to Triton 3.6's pipeliner. (In the forward, slots from
registers and 3 stages took the H200 from 466 to 562 TFLOP/s dense at 64K keys, e8cd5a4, 2026-11-30;
the dQ page loop, the same way with descriptor loads, from 12.8 to 9.4 ms, 34a47d8, 2026-11-30: rows in
bench/results/attention.jsonl.) Descriptor (TMA) loads wait on
barriers instead; a synchronous scalar load (`tt.load` of one index) inside a loop is listed too,
and the shared memory a program needs (an H100/H200 SM has 232,448 bytes for one), with the
registers per thread and the bytes spilled to local memory that ptxas reports (the one Triton
compiles with), and what Hopper instructions the PTX holds: wgmma products (commit groups), TMA
copies into shared memory and reduce-adds out of it, setmaxnreg's register counts, and the TTGIR's
warp-specialised partitions besides the default one. The dK/dV kernels run at 255 registers (8 B
spilled dense, 32 B top-k; ncu on the H200 agrees: one 8-warp program per SM). For the
warp-specialised Gluon kernel ptxas reports the launch's registers (168); its compute warps raise
theirs to 240 (setmaxnreg), the two others drop to 40; five wgmma commit groups (one per tile
product), TMA loads of K, V, Q, dO and reduce-adds of dQ (Triton 3.6 to 3.9 alike).
To see what the GPU machine's Triton does, put that version first on PYTHONPATH
(`pip install --target DIR triton==3.6.0`).

Not under TRITON_INTERPRET (the interpreter replaces the kernels): the script clears it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from oomb.attention import paged, paged_hopper  # noqa: E402
from oomb.config import KernelOptions  # noqa: E402

KERNELS = KernelOptions.from_env(os.environ)

SHAPE = dict(GROUP=7, D=128, HEAD_DIM=128, PAGE_SIZE=128, IN_PRECISION="tf32", WINDOWED=False)
DOCS = dict(KeyStart="*i32", DocEnd="*i32", PagePos="*i32")  # packed documents' tensors
BF16_GPU_Q = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16)  # what the configs look at
DESC = "tensordesc<bf16[1,1,{n},{d}]>"


def _kernel(kind: str, sparse: bool, packed: bool = False) -> tuple:
    """(jit function, pointer argument types, constexpr values, launch options) as the launchers
    in oomb.attention.paged would pass them on an H200 (packed: with packed documents)."""
    shape = dict(SHAPE, SPARSE=sparse, PACKED=packed)
    if kind == "fwd":
        cfg = paged._fwd_config(BF16_GPU_Q, 128)
        desc = DESC.format(n=cfg.BLOCK_N, d=128)
        ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", KP=desc, VP=desc, Table="*i32", Sel="*i32", Span="*i32",
                    O="*fp32", LSE="*fp32", **DOCS)
        const = dict(shape, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, INCLUDE_SELF=True, TMA=True)
        return paged._paged_attn_fwd, ptrs, const, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    cfg = paged._bwd_config(BF16_GPU_Q, 128)
    if kind == "dq":
        desc = DESC.format(n=cfg.BLOCK_N2, d=128) if KERNELS.dq_tma else "*bf16"
        ptrs = dict(Q="*bf16", DO="*bf16", LSE="*fp32", Delta="*fp32", K="*bf16", V="*bf16", KP=desc,
                    VP=desc, Table="*i32", Sel="*i32", Span="*i32", DQ="*fp32", **DOCS)
        const = dict(shape, BLOCK_M=cfg.BLOCK_M2, BLOCK_N=cfg.BLOCK_N2, INCLUDE_SELF=True, TMA=KERNELS.dq_tma)
        return paged._paged_attn_bwd_dq, ptrs, const, dict(num_warps=cfg.warps2, num_stages=cfg.stages2)
    if kind == "dkdv_own":  # the chunk's own keys (no pages: dense and top-k are the same kernel)
        ptrs = dict(Q="*bf16", DO="*bf16", LSE="*fp32", Delta="*fp32", K="*bf16", V="*bf16", DK="*fp32", DV="*fp32",
                    **DOCS)
        const = dict(shape, BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1)
        return paged._paged_attn_bwd_dkdv_own, ptrs, const, dict(num_warps=cfg.warps1, num_stages=cfg.stages1)
    qdesc = DESC.format(n=cfg.BLOCK_M1, d=128) if KERNELS.dkdv_tma else "*bf16"
    ptrs = dict(Q=qdesc, DO=qdesc, LSE="*fp32", Delta="*fp32", KP="*bf16", VP="*bf16", DKP="*bf16",
                DVP="*bf16", Table="*i32", Order="*i32", Visits="*i32", NVisits="*i32", **DOCS)
    const = dict(shape, BLOCK_M=cfg.BLOCK_M1, BLOCK_N=cfg.BLOCK_N1, TMA=KERNELS.dkdv_tma)
    return paged._paged_attn_bwd_dkdv_pages, ptrs, const, dict(num_warps=cfg.warps1, num_stages=cfg.stages1)


def _compile_hopper(arch: int):
    """paged_hopper's fused backward (Gluon; dense only) at the launch settings of backward_pages."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    def desc(rows, dtype, torch_dtype):
        return mangle_type(paged_hopper._descriptor(torch.empty((rows, 128), dtype=torch_dtype), rows, dtype))

    fn = paged_hopper._fused_bwd
    qd, kd = desc(paged_hopper.BLOCK_M, gl.bfloat16, torch.bfloat16), desc(paged_hopper.BLOCK_N, gl.bfloat16,
                                                                                torch.bfloat16)
    ptrs = dict(Q=qd, DO=qd, K=kd, V=kd, DQI=desc(paged_hopper.BLOCK_M, gl.int32, torch.int32), LSE="*fp32",
                Delta="*fp32", Fac="*fp32", Table="*i32", DKP="*fp32", DVP="*fp32")
    const = dict(GROUP=7, PAGE_SIZE=128, STAGES=paged_hopper.STAGES, num_warps=8)
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("qk_scale", "scale") else "i32")
           for n in fn.arg_names}
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8))


def compile_kernel(kind: str, sparse: bool, arch: int = 90, packed: bool = False):
    """A kernel compiled at the H200 launch settings (.asm: ttgir, ptx, ...; .metadata.shared)."""
    if kind == "hopper":
        return _compile_hopper(arch)
    fn, ptrs, const, options = _kernel(kind, sparse, packed)
    const.update(SLOTS=paged.SLOT_BATCH, MAX_BLOCKS=32)
    const = {n: v for n, v in const.items() if n in fn.arg_names}
    unknown = [n for n in fn.arg_names if n.isupper() and n not in const and n not in ptrs
               and n not in ("C", "H", "HKV")]
    if unknown:
        raise SystemExit(f"kernel_ir.py does not know the value of {unknown} for {kind}: add it to _kernel()")
    for name in fn.arg_names:
        if name.startswith("stride_") and name.endswith("d"):
            const[name] = 1  # head_dim is the contiguous dimension
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("qk_scale", "scale") else "i32")
           for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride_") or n == "C"))}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()}, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def ptxas_usage(ptx: str, arch: int = 90) -> dict:
    """Registers per thread and bytes of spill stores, from the ptxas Triton compiles with (-v)."""
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    info = out.stdout + out.stderr
    return dict(registers=int(re.search(r"Used (\d+) registers", info).group(1)),
                spill_bytes=int(re.search(r"(\d+) bytes spill stores", info).group(1)))


def hopper_ops(ptx: str, ttgir: str) -> dict:
    """The Hopper instructions of a kernel: wgmma commit groups (each async product issued), TMA
    copies global -> shared and reduce-adds shared -> global, the register counts setmaxnreg sets,
    and the warp-specialised partitions of the TTGIR (the default one not counted)."""
    return dict(wgmma_groups=len(re.findall(r"wgmma\.commit_group", ptx)),
                tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\S*\.global\.", ptx)),
                tma_reduces=len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)),
                setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\S+\s+(\d+);", ptx)}),
                partitions=len(re.findall(r"\n\s*partition\d+\(", ttgir)))


def loop_waits(ttgir: str) -> dict:
    """What the loops of a TTGIR wait for: `num` of each wait on named copies (inside loops: the
    drains after a loop name none), the barrier waits of descriptor loads, and synchronous scalar
    index loads inside loops (`tt.load` of a `!tt.ptr<i32>` indented past the function body)."""
    waits = [int(m.group(1)) for m in re.finditer(r"\n {6,}%\S+ = ttg\.async_wait %[^{]*\{num = (\d+)", ttgir)]
    barriers = len(re.findall(r"ttng\.wait_barrier", ttgir))
    scalar_loads = len(re.findall(r"\n {6,}%\S+ = tt\.load %\S+(?:, %\S+)? : !tt\.ptr<i32>", ttgir))
    return dict(waits=waits, barrier_waits=barriers, scalar_loads_in_loops=scalar_loads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = "fwd,dq,dkdv,dkdv_own" + (",hopper" if paged_hopper.AVAILABLE else "")  # hopper: Gluon
    ap.add_argument("--kinds", default=kinds)
    ap.add_argument("--dump", help="a directory for the TTGIR files")
    ap.add_argument("--json", action="store_true", help="one JSON line per kernel")
    ap.add_argument("--packed", action="store_true", help="the kernels' packed-documents variants (not hopper's)")
    args = ap.parse_args()
    for kind in args.kinds.split(","):
        for sparse in (False,) if kind in ("dkdv_own", "hopper") else (False, True):
            kernel = compile_kernel(kind, sparse, packed=args.packed)
            ir, shared = kernel.asm["ttgir"], kernel.metadata.shared
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{kind}-{'sparse' if sparse else 'dense'}.ttgir"), "w") as f:
                    f.write(ir)
            row = dict(kernel=kind, sparse=sparse, triton=triton.__version__, shared_bytes=shared, **loop_waits(ir),
                       **ptxas_usage(kernel.asm["ptx"]), **hopper_ops(kernel.asm["ptx"], ir))
            if args.json:
                print(json.dumps(row))
            else:
                stalls = sum(1 for n in row["waits"] if n == 0)
                print(f"{kind:5s} {'sparse' if sparse else 'dense ':6s} waits in loops {row['waits']} "
                      f"({stalls} with nothing in flight), barrier waits {row['barrier_waits']}, "
                      f"scalar loads in loops {row['scalar_loads_in_loops']}, {shared:,} B shared memory, "
                      f"{row['registers']} registers, {row['spill_bytes']} B spilled")


if __name__ == "__main__":
    main()
