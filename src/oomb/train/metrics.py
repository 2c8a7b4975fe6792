"""Progress: one line per logged step (loss, tokens/s, memory) and per evaluation (held-out
loss), each also appended as JSON to <output-dir>/metrics.jsonl for plotting; the copy task's
loss on each half at the end of its run; and a bar over the chunks of a step while it runs (a
1M-token step takes minutes)."""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated (CUDA) or the process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def host_rss_bytes() -> int | None:
    """This process's resident host memory now (Linux: /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_now(device: torch.device, pinned_bytes: int) -> dict:
    """GiB in use now: GPU allocated and reserved (CUDA), host resident set, pinned host memory."""
    gib = 2**30
    out = {"pinned_gib": round(pinned_bytes / gib, 4)}
    rss = host_rss_bytes()
    if rss is not None:
        out["host_rss_gib"] = round(rss / gib, 4)
    if device.type == "cuda":
        out["gpu_alloc_gib"] = round(torch.cuda.memory_allocated(device) / gib, 4)
        out["gpu_reserved_gib"] = round(torch.cuda.memory_reserved(device) / gib, 4)
    return out


class StepLogger:
    def __init__(self, total_steps: int, device: torch.device, stream=None, metrics: str | None = None) -> None:
        self.total_steps = total_steps
        self.device = device
        self.stream = stream if stream is not None else sys.stdout  # the one of now (not of import time)
        self.metrics = metrics  # a .jsonl path, appended to (a resumed run continues the same file)
        if metrics:
            os.makedirs(os.path.dirname(metrics) or ".", exist_ok=True)
        self.start = time.perf_counter()

    def log(self, step: int, loss: float, tokens: int, seconds: float, lr: float, grad_norm: float,
            memory: dict | None = None) -> dict:
        """memory: memory_now()'s figures after the step (and the trainer's host_layers), recorded
        in metrics.jsonl (a soak run's evidence that nothing grows from step to step: bench/soak.py)."""
        elapsed = time.perf_counter() - self.start
        eta = elapsed / step * (self.total_steps - step) if step else 0.0
        mem = peak_memory_gib(self.device)
        print(f"step {step:>5}/{self.total_steps}  loss {loss:.4f}  {tokens / seconds:,.0f} tok/s  "
              f"lr {lr:.2e}  grad_norm {grad_norm:.3f}  mem {mem:.2f} GiB  "
              f"elapsed {elapsed:.0f}s  eta {eta:.0f}s", file=self.stream, flush=True)
        # CUDA: what the caching allocator held at most too (a step fails when that reaches the GPU's size)
        reserved = ({"peak_reserved_gib": round(torch.cuda.max_memory_reserved(self.device) / 2**30, 3)}
                    if self.device.type == "cuda" else {})
        return self._record({"step": step, "loss": loss, "tokens": tokens, "step_s": round(seconds, 3),
                             "tok_s": round(tokens / seconds, 1), "lr": lr, "grad_norm": grad_norm,
                             "peak_mem_gib": round(mem, 3), **reserved, **(memory or {})})

    def log_skipped(self, step: int, loss: float, grad_norm: float, in_a_row: int) -> dict:
        """A step whose loss or gradient norm was not finite: no optimizer step (metrics.jsonl keeps
        the count; JSON has no NaN, so the values are strings)."""
        return self._record({"step": step, "skipped": True, "loss": str(loss), "grad_norm": str(grad_norm),
                             "bad_in_a_row": in_a_row})

    def log_eval(self, step: int, loss: float, tokens: int, seconds: float, recall: dict | None = None) -> dict:
        """recall: the held-out recall pairs' accuracy by distance bucket (data/recall.py)."""
        by = "  recall " + ", ".join(f"{k} {v:.2f}" for k, v in recall.items()) if recall else ""
        print(f"eval {step:>5}/{self.total_steps}  loss {loss:.4f}  ppl {math.exp(min(loss, 700)):.2f}  "
              f"({tokens:,} tokens, {seconds:.1f}s){by}", file=self.stream, flush=True)
        return self._record({"step": step, "eval_loss": loss, "eval_tokens": tokens, "eval_s": round(seconds, 3),
                             **({"eval_recall": recall} if recall else {})})

    def log_copy(self, first: float, copied: float, entropy: float, distance: int,
                 earlier_chunk: bool = False) -> None:
        """The copy task's last line: held-out loss on the random first half (its floor: the unigram
        entropy) against the copied half, which only attention `distance` tokens back predicts."""
        where = ", in an earlier chunk's pages" if earlier_chunk else ""
        meaning = (f"the model retrieves each copied token from {distance:,} tokens back{where}"
                   if copied < entropy / 2 else
                   "the copy is not learnt yet (its loss is near the unigram entropy): train longer (--steps)")
        print(f"copy task (held out): loss {copied:.2f} on the copied half vs {first:.2f} on the random first half "
              f"(unigram entropy {entropy:.2f}): {meaning}", file=self.stream, flush=True)

    def _record(self, row: dict) -> dict:
        """Appends `row` to metrics.jsonl; returns it (the callbacks get the same row)."""
        if self.metrics:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


class ChunkBars:
    """progress(done, total) for the engine: a tqdm bar of chunk passes per engine call (made at
    its first pass, when the call's size is known; closed at its last), drawn only on a terminal
    (tqdm turns itself off when stderr is not a TTY, so logs stay clean). `{n}` in desc is the
    call's number, for a series of calls."""

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self.desc, self.enabled, self.calls, self.bar = desc, enabled, 0, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.calls += 1
            self.bar = tqdm(total=total, desc=self.desc.format(n=self.calls), unit="chunk", leave=False,
                            disable=None if self.enabled else True, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def chunk_progress(desc: str, enabled: bool = True):
    """ChunkBars for one engine call, closed when the block ends (also when the call fails)."""
    bars = ChunkBars(desc, enabled)
    try:
        yield bars
    finally:
        bars.close()
