"""The forward and dQ kernels' loops keep their next tiles in flight: compiled for sm_90 on the
CPU (bench/kernel_ir.py, H200 launch settings), each loop's wait leaves copies outstanding and no
index is loaded synchronously inside a loop. A load in a loop's address chain (a page table, a
selection) makes Triton's pipeliner wait for every copy at the top of each iteration instead:
on the H200 the forward ran at 466 instead of 562 TFLOP/s dense, 1.39 instead of 1.13 ms at top-k
64 (e8cd5a4, 2026-11-30), and the dQ kernel took 12.8 instead of 9.4 ms at 64K keys (34a47d8,
2026-11-30; bench/results/attention.jsonl). Every kernel (with Triton 3.6, also paged_hopper's Gluon
backward) fits an H200's shared memory at those settings."""
import json
import os
import subprocess
import sys

from oomb.attention import paged_hopper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_LIMIT = 232448  # bytes of shared memory an H100/H200 program may use


def test_forward_and_dq_loops_are_pipelined():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "kernel_ir.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=900, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    hopper = {("hopper", False)} if paged_hopper.AVAILABLE else set()  # kernel_ir.py's default kinds
    assert {(r["kernel"], r["sparse"]) for r in rows} == {
        *((k, s) for k in ("fwd", "dq", "dkdv") for s in (False, True)), ("dkdv_own", False), *hopper}
    for r in rows:
        assert r["shared_bytes"] <= SHARED_LIMIT, r
        if r["kernel"] in ("fwd", "dq"):
            assert r["waits"] and min(r["waits"]) > 0, f"a loop waits with nothing in flight: {r}"
            assert r["scalar_loads_in_loops"] == 0, f"an index loaded synchronously inside a loop: {r}"
