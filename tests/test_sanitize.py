"""bench/sanitize.py: the summary parser on compute-sanitizer's outputs, the children under the
Triton interpreter, and a clear refusal where no GPU (or no usable sanitizer) is found."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "sanitize.py")
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "TRITON_INTERPRET": "1"}

MEMCHECK_CLEAN = """========= COMPUTE-SANITIZER
sanitize: forward ok (4.1 s)
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_ERRORS = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 2 bytes
=========     at _paged_attn_fwd+0x1a70 in /repo/src/oomb/attention/paged_forward.py:120
=========     by thread (64,0,0) in block (1,3,0)
=========     Address 0x7f3e4c000200 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3e4c000000 of size 512 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2f1e3] in libcuda.so.1
=========
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaStreamSynchronize.
=========
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_CLEAN = """========= COMPUTE-SANITIZER
sanitize: sparse ok (6.0 s)
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
RACECHECK_HAZARDS = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at _fused_bwd+0x2b40 in paged_hopper.py:230
=========     and Read access at _fused_bwd+0x2c10 in paged_hopper.py:236 [512 hazards]
=========
========= Warning: Race reported between Read access at _paged_attn_bwd_dq+0x910 in paged_backward.py:301
=========     and Write access at _paged_attn_bwd_dq+0x990 in paged_backward.py:305 [64 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""
REFUSED = """========= COMPUTE-SANITIZER
========= Error: Target application terminated before first instrumented API call
"""


def test_summary_parser():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from sanitize import parse

    assert parse(MEMCHECK_CLEAN) == {"errors": 0, "summary": "ERROR SUMMARY: 0 errors", "api_errors": 0}
    assert parse(MEMCHECK_ERRORS) == {"errors": 2, "summary": "ERROR SUMMARY: 2 errors", "api_errors": 1}
    assert parse(RACECHECK_CLEAN) == {"errors": 0, "hazards": 0, "warnings": 0, "api_errors": 0,
                                      "summary": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"}
    race = parse(RACECHECK_HAZARDS)
    assert (race["errors"], race["hazards"], race["warnings"]) == (1, 2, 1)
    both = parse(RACECHECK_CLEAN + "========= ERROR SUMMARY: 0 errors\n")  # racecheck may print both summaries
    assert both["errors"] == 0 and both["summary"].endswith("; ERROR SUMMARY: 0 errors")
    assert parse(REFUSED)["errors"] is None and parse(REFUSED)["summary"] is None


def test_children_under_the_interpreter():
    """The Triton kernels' children run interpreted on the CPU; the CUDA-only ones say why they skip."""
    out = subprocess.run([sys.executable, SCRIPT, "--kernel", "forward,sparse,hopper-backward,gather"], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("sanitize: ")]
    assert [line.split()[1:3] for line in lines] == [["forward", "ok"], ["sparse", "ok"],
                                                      ["hopper-backward", "skipped:"], ["gather", "skipped:"]]
    assert "sm_90" in lines[2] and "pinned host memory" in lines[3]


def test_parent_refuses_clearly_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        return  # the GPU machine runs the real thing
    results = tmp_path / "sanitize.jsonl"
    out = subprocess.run([sys.executable, SCRIPT, "--results", str(results), "--log-dir", str(tmp_path / "logs")],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "sanitize: no CUDA GPU here" in out.stderr
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert row["status"] == "unavailable" and row["commit"] and row["date"]
