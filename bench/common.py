"""What every benchmark shares: run metadata and the results files docs/benchmarks.md is made from."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess

import torch


def run_info() -> dict:
    """GPU, versions, commit and date, stored with every result row."""
    import transformers
    import triton

    here = os.path.dirname(os.path.abspath(__file__))
    # The GPU machine gets a copy of the working tree without .git: the caller passes OOMB_COMMIT.
    commit = os.environ.get("OOMB_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=here).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def record(path: str, row: dict) -> None:
    """Print a result row and append it to the results file at once (a run cut short keeps
    every row it measured)."""
    print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def profiled(enabled: bool, out_dir: str, name: str, window: tuple[int, int] | None = None):
    """torch.profiler around a step (CPU + CUDA), its trace written to out_dir (read it with
    bench/trace_gaps.py); else nothing.

    window (first, count): record only `count` chunk passes after the first `first` (the caller
    calls prof.step() after each pass): a sample of a long step, whose whole trace would be too
    big. Passes are counted as the host queues them, up to two chunks ahead of the GPU.
    """
    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    when = None if window is None else schedule(wait=window[0], warmup=1, active=window[1], repeat=1)
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=when,
                   on_trace_ready=tensorboard_trace_handler(out_dir, worker_name=name))
