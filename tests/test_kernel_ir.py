"""The kernels compiled for sm_90 on the CPU (bench/kernel_ir.py, H200 launch settings).

The forward and dQ kernels' loops keep their next tiles in flight: each loop's wait leaves copies
outstanding and no index is loaded synchronously inside a loop. A load in a loop's address chain
(a page table, a selection) makes Triton's pipeliner wait for every copy at the top of each
iteration instead: on the H200 the forward ran at 466 instead of 562 TFLOP/s dense, 1.39 instead
of 1.13 ms at top-k 64 (e8cd5a4, 2026-11-30), and the dQ kernel took 12.8 instead of 9.4 ms at 64K
keys (34a47d8, 2026-11-30; bench/results/attention.jsonl). Every kernel fits an H200's shared
memory at those settings.

paged_hopper's Gluon backward compiles with the Triton installed here (the one torch brings), so a
Triton release that moves a Gluon API the kernel uses fails here instead of sending Hopper GPUs to
the slower Triton kernels unnoticed."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import triton

from oomb.attention import paged_hopper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_LIMIT = 232448  # bytes of shared memory an H100/H200 program may use


def _kernel_ir(kinds: str) -> list[dict]:
    """bench/kernel_ir.py's JSON rows for `kinds`, run without the interpreter, with this process's
    PYTHONPATH after src (the same Triton)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_ir.py"), "--json", "--kinds", kinds],
                         env=env, capture_output=True, text=True, timeout=900, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_forward_and_dq_loops_are_pipelined():
    rows = _kernel_ir("fwd,dq,dkdv,dkdv_own")
    assert {(r["kernel"], r["sparse"]) for r in rows} == {
        *((k, s) for k in ("fwd", "dq", "dkdv") for s in (False, True)), ("dkdv_own", False)}
    for r in rows:
        assert r["shared_bytes"] <= SHARED_LIMIT, r
        if r["kernel"] in ("fwd", "dq"):
            assert r["waits"] and min(r["waits"]) > 0, f"a loop waits with nothing in flight: {r}"
            assert r["scalar_loads_in_loops"] == 0, f"an index loaded synchronously inside a loop: {r}"


def test_hopper_backward_compiles_for_sm90():
    """The fused backward as paged_hopper's docstring draws it: three partitions (the compute
    warpgroups, a TMA loader warp and a dQ warp; the two workers at 40 registers, the compute warps
    raised to 240), five wgmma products a query tile, Q, dO, K, V loaded by TMA and dQ added by TMA
    reduce, in an H200's shared memory."""
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        pytest.skip(f"Triton {triton.__version__} has no Gluon (triton.experimental.gluon): nothing to compile")
    assert paged_hopper.AVAILABLE, (
        f"Triton {triton.__version__} has Gluon but not the features paged_hopper looks up (its import block): "
        "Hopper GPUs would take the Triton kernels")
    [r] = _kernel_ir("hopper")
    assert r["shared_bytes"] <= SHARED_LIMIT, r
    assert r["partitions"] == 2 and {40, 240} <= set(r["setmaxnreg"]), f"not warp-specialised as written: {r}"
    assert r["wgmma_groups"] == 5, f"the five tile products are not five async wgmma groups: {r}"
    assert r["tma_loads"] >= 4 and r["tma_reduces"] >= 1, f"Q, dO, K, V not loaded / dQ not added by TMA: {r}"
