"""bench/sanitize.py: the summary parser on compute-sanitizer's outputs, the children under the
Triton interpreter, and a clear refusal where no GPU (or no usable sanitizer) is found."""
import json
import os
import subprocess
import sys

import pytest

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
    out = subprocess.run([sys.executable, SCRIPT, "--kernel", "forward,sparse,hopper-backward,gather,ws-control"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("sanitize: ")]
    assert [line.split()[1:3] for line in lines] == [["forward", "ok"], ["sparse", "ok"],
                                                      ["hopper-backward", "skipped:"], ["gather", "skipped:"],
                                                      ["ws-control", "skipped:"]]
    assert "sm_90" in lines[2] and "pinned host memory" in lines[3] and "sm_90" in lines[4]


# The racecheck controls compiled offline for sm_90, all variants, in a child process without
# TRITON_INTERPRET: in this process the interpreter may have run kernels before (they leave
# triton.language's builtins patched), and a compile then reaches its builder.
COMPILE_WS_CONTROLS = """
import importlib.util, json, sys, warnings
warnings.filterwarnings("ignore", "TRITON_DEFAULT_FP_FUSION is unset")  # Triton 3.9's notice of a coming default
import triton
from triton.backends.compiler import GPUTarget
from oomb.attention import paged_hopper
if not paged_hopper.AVAILABLE:
    print(json.dumps({"skip": f"Triton {triton.__version__} lacks the Gluon features paged_hopper uses"}))
    sys.exit()
from triton.experimental.gluon._runtime import GluonASTSource
spec = importlib.util.spec_from_file_location("sanitize", sys.argv[1])
sanitize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sanitize)
signature = {"out": "*fp32", "Base": "*i32", "BLOCK": "constexpr", "WARPS": "constexpr", "BAR": "constexpr",
             "MBAR": "constexpr", "CAPTURE": "constexpr"}
asm = {}
for variant, (bar, mbar, capture) in sanitize.WS_VARIANTS.items():
    src = GluonASTSource(sanitize._ws_control, signature,
                         constexprs={(2,): 256, (3,): 8, (4,): bar, (5,): mbar, (6,): capture})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    asm[variant] = {"ttgir": k.asm["ttgir"], "ptx": k.asm["ptx"], "bar": bar, "mbar": mbar, "capture": capture}
print(json.dumps(asm))
"""


@pytest.fixture(scope="module")
def ws_controls():
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE_WS_CONTROLS, SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = json.loads(out.stdout.splitlines()[-1])
    if "skip" in compiled:
        pytest.skip(compiled["skip"])
    return compiled


@pytest.mark.parametrize("variant", ["ws-control", "ws-control-bar", "ws-control-mbarrier", "ws-control-capture",
                                     "ws-control-all"])
def test_ws_controls_compile_for_sm90_as_the_hopper_kernel_specialises(ws_controls, variant):
    """The racecheck controls are warp-specialised as paged_hopper._fused_bwd is (a default partition
    and two one-warp workers), and their workers get their start state as the Hopper kernel's do:
    through shared memory the default partition writes, behind a named barrier; each variant adds
    what it names: a barrier of the default partition's warps only (bar.sync 0 with a count), an
    mbarrier, a value handed to a worker through shared memory. Compiled offline with the installed
    Triton, for sm_90."""
    import re

    k = ws_controls[variant]
    ttgir, ptx, bar, mbar, capture = k["ttgir"], k["ptx"], k["bar"], k["mbar"], k["capture"]
    assert "ttg.warp_specialize" in ttgir and "partition1" in ttgir and "partition2" not in ttgir
    assert "st.shared" in ptx and re.search(r"barrier\.sync\s+1;", ptx) and "ld.shared" in ptx
    if bar:
        assert re.search(r"bar(rier)?\.sync(\.aligned)?\s+0,\s*256;", ptx), "no barrier of the default partition's warps"
    elif not mbar:  # (an mbarrier's init may bring one of its own)
        assert not re.search(r"bar(rier)?\.sync(\.aligned)?\s+0,", ptx)
    assert ("mbarrier.init" in ptx) == mbar
    assert (len(re.findall(r"ld\.shared", ptx)) > 1) == capture, "a captured value is read from shared memory"


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
