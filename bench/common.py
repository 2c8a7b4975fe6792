"""What every benchmark shares: run metadata and the results files docs/benchmarks.md is made from."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import subprocess
import time

import torch

# The benchmarks' LoRA (bench_step, before_after): adapters on the attention projections. `oomb
# train --lora-rank` adapts the family's lora_targets (the MLP's too); the report plans the rows as
# measured (report_plan.row_engine).
BENCH_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


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
    info = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OOMB_") and k != "OOMB_COMMIT"}
    if switches:  # the kernels' and engine's environment switches (OOMB_TMA=0, OOMB_DMA=0, ...: KernelOptions.ENV)
        info["switches"] = switches
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        info["alloc_conf"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    return info


def logged_steps(lines: list[str]) -> list[dict]:
    """The logged training steps among the lines of `oomb train`'s metrics.jsonl (not skipped
    steps, evaluations, or a line still being written)."""
    rows = []
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "step" in r and "step_s" in r and not r.get("skipped"):
            rows.append(r)
    return rows


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


class GpuMeter:
    """The GPU's SM clock and power while a step runs, sampled by `nvidia-smi` every 200 ms
    in a child process: a long training step on an H200 runs at its 700 W cap, where the clock
    drops from 1,980 MHz to ~1,600-1,800 MHz, while a kernel benchmark's short bursts run at
    full clock (H200, 2026-11-30, 7c7f11b). So a kernel's gain in bench_attention.py
    shrinks in the step; these fields say how far each step was power-bound.

    summary(): sm_mhz (mean), power_w (mean), power_capped (share of samples whose clock was
    held down by the software power cap); {} where nvidia-smi is missing or printed nothing.
    stop() ends the sampler without a summary (a step that failed)."""

    POWER_CAP = 0x4  # clocks_event_reasons: SW power cap

    def __init__(self, cuda: bool) -> None:
        self.proc = None
        if not cuda:
            return
        try:
            gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (OSError, AttributeError, RuntimeError):
            self.proc = None

    def summary(self) -> dict:
        """Stop sampling; the means over the samples taken."""
        return self.parse(self.stop())

    def stop(self) -> str:
        """End the sampler (again: nothing); what it printed."""
        if self.proc is None:
            return ""
        proc, self.proc = self.proc, None
        proc.terminate()
        return proc.communicate()[0]

    @classmethod
    def parse(cls, text: str) -> dict:
        samples = []
        for line in text.splitlines():
            try:
                mhz, watts, reasons = (x.strip() for x in line.split(","))
                samples.append((float(mhz), float(watts), int(reasons, 16)))
            except ValueError:  # a header, a cut-off last line, "[N/A]"
                continue
        if not samples:
            return {}
        n = len(samples)
        return {"sm_mhz": round(sum(s[0] for s in samples) / n), "power_w": round(sum(s[1] for s in samples) / n),
                "power_capped": round(sum(bool(s[2] & cls.POWER_CAP) for s in samples) / n, 2)}


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


@contextlib.contextmanager
def memory_traced(enabled: bool, top: int = 15, out: str = ""):
    """torch.cuda.memory history around a block; after it, the allocations live at the block's
    peak grouped by the oomb/transformers lines that made them, printed (and written to `out` as
    JSON, when given): where a step's peak memory goes."""
    if not enabled:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, sites = peak_allocations(snapshot)
        print(f"peak of the traced allocations: {peak / 2**30:.2f} GiB above what was live before; at the peak:",
              flush=True)
        for key, (size, count) in sites[:top]:
            print(f"{size / 2**30:8.3f} GiB {count:6d} x  {key}", flush=True)
        if out:
            with open(out, "w") as f:
                json.dump({"peak_bytes": peak, "sites": [[k, s, c] for k, (s, c) in sites]}, f, indent=1)


def peak_allocations(snapshot: dict) -> tuple[int, list]:
    """(bytes at the peak, [(site, (bytes, count))] largest first) of the allocations a
    torch.cuda.memory snapshot's trace made and had not freed at its peak; a site is the first
    three oomb/transformers/peft frames of the allocation's stack."""
    live, now, best, at_best = {}, 0, 0, {}
    for trace in snapshot["device_traces"]:
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                now += e["size"]
                if now > best:
                    best, at_best = now, dict(live)
            elif e["action"] == "free_completed" and e["addr"] in live:
                now -= live.pop(e["addr"])["size"]
    sites = {}
    for e in at_best.values():
        frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e["frames"]
                  if any(k in f["filename"] for k in ("oomb", "modeling", "peft", "bench"))][:3]
        key = " <- ".join(frames) or "(no Python frame: autograd engine)"
        size, count = sites.get(key, (0, 0))
        sites[key] = (size + e["size"], count + 1)
    return best, sorted(sites.items(), key=lambda kv: -kv[1][0])


# --- oomb steps ------------------------------------------------------------------------------

def packed_positions(tokens: int, packed_docs: int, device) -> torch.Tensor | None:
    """position_ids (1, tokens) of documents of packed_docs tokens (at most half the sequence, so
    that a short warm-up still crosses a document boundary), or None when not packed."""
    if not packed_docs:
        return None
    return (torch.arange(tokens, device=device) % max(1, min(packed_docs, tokens // 2)))[None]


def warm_up_tokens(length: int, chunk_size: int, page_size: int, group_pages: int, chunks: int) -> int:
    """Tokens of a warm-up step: `chunks` chunks, and past one group of `group_pages` pages (the
    kernels' later groups run without the chunk's own keys, a variant of their own); at most
    `length`."""
    return min(length, max(chunks * chunk_size, (group_pages + 1) * page_size + chunk_size))


def warm_up(engine, tokens: int, packed_docs: int = 0) -> None:
    """One step of `tokens` random tokens with as many layers' pages on the host as the length the
    engine was reserved for puts there (a fixed page budget places them), so that the kernels and
    compiled layers the timed step runs are compiled before it; packed into documents of at most
    packed_docs tokens when given (their kernels are variants of their own)."""
    model, config = engine.model, engine.config
    n_host = len(engine.store.host_layers)
    if n_host:
        stored = (-(-tokens // config.chunk_size) - 1) * (config.chunk_size // config.page_size)
        n_device = engine.adapter.n_layers - len(engine.store.tail_pages) - n_host
        engine.config = config.replace(gpu_page_budget_bytes=n_device * stored * engine.store.layer_page_bytes)
    try:
        engine.forward_backward(torch.randint(0, model.config.vocab_size, (1, tokens), device=model.device),
                                position_ids=packed_positions(tokens, packed_docs, model.device))
        assert len(engine.store.host_layers) == n_host, "the warm-up placed other layers on the host"
    finally:
        engine.config = config


def torchrun_device(device: str, launch: str, cpu_hint: str) -> bool:
    """For a script launched by torchrun: exits with how to launch it (`launch`) or what --device cpu
    does (`cpu_hint`) when it cannot run; hides the GPUs for a gloo run on CPU processes. True: CUDA."""
    if "WORLD_SIZE" not in os.environ:
        sys.exit(f"launch with torchrun, e.g. {launch}")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit(f"--device cuda needs CUDA GPUs ({cpu_hint})")
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU tensors even on a GPU machine
    return cuda
