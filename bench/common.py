"""What every benchmark shares: run metadata and the results files docs/benchmarks.md is made from."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import time

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


class PassClock:
    """When each chunk pass of an oomb step ends: a CUDA event recorded on the compute stream as
    the host queues the pass (the engine's progress callback: no sync), or the host clock on
    the CPU. summary() then splits the step into stage 1 and stage 2 and shows, per stage, how a
    chunk's time depends on its position (quarters of the sequence): where a long step's
    extra time goes, without a profiler."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.marks = cuda, []
        self._mark()

    def _mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def __call__(self, done: int, total: int) -> None:
        self._mark()

    def summary(self) -> dict:
        """After the step (synchronised): stage1_s, stage2_s, and each stage's mean ms per chunk
        over the sequence's quarters, by chunk position (stage 2 runs them last to first)."""
        if self.cuda:
            ms = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            ms = [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]
        n = (len(ms) + 1) // 2  # chunks: stage 1 passes chunks 0 .. n - 2, stage 2 n - 1 .. 0
        stage1, stage2 = ms[: n - 1], ms[n - 1:][::-1]

        def quarters(x: list[float]) -> list[float]:
            if len(x) < 4:  # too few chunks for quarters: each one's
                return [round(v, 1) for v in x]
            parts = [x[i * len(x) // 4:(i + 1) * len(x) // 4] for i in range(4)]  # none empty
            return [round(sum(p) / len(p), 1) for p in parts]

        return {"stage1_s": round(sum(stage1) / 1e3, 2), "stage2_s": round(sum(stage2) / 1e3, 2),
                "stage1_chunk_ms": quarters(stage1), "stage2_chunk_ms": quarters(stage2)}


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
