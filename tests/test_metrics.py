"""train/metrics.py: what the trainer shows and logs while it runs."""
import io
import json
import sys

import torch

from oomb.train.metrics import StepLogger, chunk_progress


def test_chunk_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err, sys.stderr = sys.stderr, Terminal()
    try:
        with chunk_progress("step 1") as progress:
            for done in range(1, 8):
                progress(done, 7)
        drawn = sys.stderr.getvalue()
    finally:
        sys.stderr = err
    assert "step 1:" in drawn and "/7 [" in drawn  # the bar shows the step's 7 chunk passes


def test_a_cuda_step_logs_its_peak_allocated_and_reserved(tmp_path, monkeypatch):
    """metrics.jsonl has both peaks of a CUDA step: what tensors held and what the caching allocator
    held (the one that meets the GPU's size); a CPU step has no reserved figure."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 100 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 104.5 * 2**30)
    for device in ("cuda", "cpu"):
        path = tmp_path / f"{device}.jsonl"
        StepLogger(1, torch.device(device), stream=io.StringIO(), metrics=str(path)).log(1, 2.0, 4096, 2.0, 1e-3, 0.5)
        row = json.loads(path.read_text())
        if device == "cuda":
            assert (row["peak_mem_gib"], row["peak_reserved_gib"]) == (100.0, 104.5)
        else:
            assert "peak_reserved_gib" not in row and row["peak_mem_gib"] > 0
