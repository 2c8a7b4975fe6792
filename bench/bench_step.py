"""One training step (forward + backward, no optimizer) of a preset model with random bf16
weights (default Qwen2.5-7B shape, full-parameter gradients; --lora-rank: adapters on
attention, base frozen): oomb vs transformers + SDPA + gradient checkpointing, and + Liger
kernels when importable. Each implementation runs in its own process (clean peak-memory
counters), one after the other in the same command.

    python bench/bench_step.py --impls oomb,liger,hf --lengths 32K,64K,128K,256K
    python bench/bench_step.py --impls oomb-default,liger --lengths 32K,64K --repeats 3   # medians of 3 steps
    python bench/bench_step.py --impls oomb-sparse-auto --lengths 64K,256K,1M --kv-grad-dtype bf16
    python bench/bench_step.py --model gpt-oss-20b --lora-rank 16 --impls oomb-sparse-auto --lengths 128K,1M
    python bench/bench_step.py --impls oomb,liger --oomb-liger --lengths 64K   # oomb with Liger's norm/MLP
    python bench/bench_step.py --impls oomb,liger --oomb-compile --lengths 64K  # oomb's layers via torch.compile
    python bench/bench_step.py --impls oomb,liger --oomb-compile --float8 tensorwise --lengths 64K  # both float8

Prints and appends one JSON line per (impl, length) to --out: step seconds (with --repeats, the
median of that many steps of the same tokens, each in step_times), tokens/s, peak GPU memory, and
the oomb memory plan for comparison.

`oomb-train` and `oomb-sparse-train` time `oomb train` itself instead, with no flags but the
model, the length, --lora-rank (and top-k 64): --train-steps optimizer steps, each as its
metrics.jsonl logs it (data, forward and backward, gradient clipping, AdamW's step); the row's
step_s is the median of the steps after the first (which compiles and warms up):

    python bench/bench_step.py --impls oomb-default,oomb-train --lengths 64K
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BENCH_LORA_TARGETS, GpuMeter, PassClock, logged_steps, memory_traced,  # noqa: E402
                    packed_positions, profiled, record, run_info, warm_up, warm_up_tokens)

from oomb.memory.device import ALLOCATOR_SETTINGS  # noqa: E402
from oomb.units import parse_tokens  # noqa: E402


def build(name: str, layers: int, liger: bool, lora_rank: int = 0, device: str = "cuda", oomb_liger: bool = False,
          float8: str = "none"):
    from oomb.presets import load_model

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    torch.manual_seed(0)
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_model(name, dtype=dtype, device=device, **overrides)
    model.config._attn_implementation = "sdpa"
    model.train()
    if oomb_liger:  # Liger's RMSNorm and SwiGLU modules inside oomb's chunks
        from oomb.models.liger import apply_liger

        apply_liger(model)
    if lora_rank:  # adapters on the attention projections, the base frozen
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                           target_modules=list(BENCH_LORA_TARGETS)))
    if float8 != "none":  # torchao float8 GEMMs in the decoder layers' projections
        from oomb.models.float8 import apply_float8

        apply_float8(model, float8)
    return model


GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEEP = {"no": False, "yes": True, "fit": None}  # --keep-attention -> the engine's keep_attention
OOMB_OFFLOAD = {"oomb": "none", "oomb-all": "all", "oomb-auto": "auto", "oomb-sparse": "none",
                "oomb-sparse-all": "all", "oomb-sparse-auto": "auto", "oomb-default": "auto",
                "oomb-sparse-default": "auto"}
DEFAULT_IMPLS = ("oomb-default", "oomb-sparse-default")  # what oomb train chooses (dense, --sparse-budget 64)


def default_step_fn(model, model_name: str, lora_rank: int, sparse_budget: int = 0, packed_docs: int = 0):
    """(step, reserve) of `oomb-default`: for each length, the engine `oomb train` builds with no
    tuning flags (trainer.run_engine_config: oomb.auto's choice on this machine's memory, with
    room for AdamW's state; offload 'auto', kept attention as far as it fits, compile 'auto').
    reserve(tokens) builds it for that length (pages and pinned memory allocated, its kernels
    and compiled layers warmed up on a few chunks, packed into documents as the timed step is when
    packed_docs), so the timed step is a training run's second."""
    import gc

    import oomb
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import make_optimizer, run_engine_config

    state = {}

    def reserve(tokens: int) -> None:
        if state.get("tokens") == tokens:
            return
        state.clear()
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = TrainConfig(model=model_name, seq_len=tokens, lora_rank=lora_rank, sparse_budget=sparse_budget)
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)  # no state yet
        settings, choice = run_engine_config(cfg, model, model.device, optimizer,
                                             oomb.KernelOptions.from_env(os.environ))
        print(f"[default {tokens:,}] {choice.summary()}", file=sys.stderr, flush=True)
        engine = oomb.ChunkRecurrentEngine(model, settings)
        engine.reserve(1, tokens)
        # past one group of pages (the kernels' later groups run without the chunk's own keys, a
        # variant of their own), with the timed length's layers on the host (the host path's kernels)
        warm_up(engine, warm_up_tokens(tokens, settings.chunk_size, settings.page_size, settings.group_pages, 3),
                packed_docs)
        for p in model.parameters():
            p.grad = None
        state.update(tokens=tokens, engine=engine, choice=choice)

    def step(ids, progress=None, position_ids=None):
        reserve(ids.shape[1])
        return state["engine"].forward_backward(ids, progress=progress, position_ids=position_ids).loss

    step.engine = lambda: state["engine"]
    step.choice = lambda: state["choice"]
    return step, reserve


def step_fn(impl: str, model, chunk_size: int, kv_grad_dtype: str = "fp32", checkpoint_layers: bool = False,
            compile_layers: bool = False, param_grad_dtype: str = "param", keep_attention: str = "no",
            page_budget_gib: float | None = None, kept_host_gib: float | None = None, group_pages: int = 1024):
    """(step, reserve): step(ids) runs one step and returns the loss; reserve(tokens) makes
    oomb's page pool and pinned host arena ready for that length, as a training run does once
    before its first step (pinning ~100 GiB takes about a minute: not part of a step), and
    warms up the host path when offload puts layers there (its kernels compile at first use:
    ~4 s once, which a training run pays in its first step only)."""
    if impl in OOMB_OFFLOAD and impl not in DEFAULT_IMPLS:
        import oomb

        sparse = oomb.TopKPages(budget=64) if "sparse" in impl else None
        engine = oomb.ChunkRecurrentEngine(model, chunk_size=chunk_size, page_size=128, backend="auto",
                                           group_pages=group_pages, kernels=oomb.KernelOptions.from_env(os.environ),
                                           offload=OOMB_OFFLOAD[impl], sparse=sparse,
                                           kv_grad_dtype=GRAD_DTYPES[kv_grad_dtype],
                                           checkpoint_layers=checkpoint_layers, compile_layers=compile_layers,
                                           param_grad_dtype=torch.float32 if param_grad_dtype == "fp32" else None,
                                           keep_attention=KEEP[keep_attention],
                                           kept_host_bytes=None if kept_host_gib is None else int(kept_host_gib * 2**30),
                                           gpu_page_budget_bytes=None if page_budget_gib is None
                                           else int(page_budget_gib * 2**30))

        def step(ids, progress=None, position_ids=None):
            return engine.forward_backward(ids, progress=progress, position_ids=position_ids).loss

        step.engine = lambda: engine

        def reserve(tokens: int) -> None:
            engine.reserve(1, tokens)
            if engine.store.host_layers:  # the host path's kernels compile at their first use
                warm_up(engine, 2 * chunk_size)
        return step, reserve
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def hf_step(ids, progress=None, position_ids=None):
        if position_ids is not None:  # packed documents: the same tokens as a batch of separate sequences
            ids = ids.view(-1, int(position_ids[0].argmax()) + 1)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss
    return hf_step, lambda tokens: None


def engine_fields(engine) -> dict:
    """What a row records of the oomb engine that ran its step."""
    return {"host_layers": len(engine.store.host_layers),  # layers whose pages offload put on the host
            "kept_layers": len(engine.kept.layers), "kept_where": engine.kept.where,
            "kept_host_layers": len(engine.kept.host_layers),
            "kept_host_gib": round(engine.kept.arena_bytes / 2**30, 2),
            # how stage 2 moves a sparse host layer's selected pages (memory/dma.py)
            "copy_engines": engine.store.host.dma is not None}


def worker(args) -> None:
    info = run_info()
    cuda = args.device == "cuda"
    if cuda and args.gpu_cap_gib:  # a smaller GPU's memory (not its speed): the allocator's cap
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, args.gpu_cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory))
    oomb_liger = args.oomb_liger and args.impl in OOMB_OFFLOAD
    model = build(args.model, args.layers, args.impl == "liger", args.lora_rank, args.device, oomb_liger, args.float8)
    weights_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
    compile_layers = args.oomb_compile and args.impl in OOMB_OFFLOAD
    if args.impl in DEFAULT_IMPLS:
        step, reserve = default_step_fn(model, args.model, args.lora_rank, 64 if "sparse" in args.impl else 0,
                                        args.packed_docs)
    else:
        step, reserve = step_fn(args.impl, model, args.chunk_size, args.kv_grad_dtype, args.checkpoint_layers,
                                compile_layers, args.param_grad_dtype, args.keep_attention, args.page_budget_gib,
                                args.kept_host_gib, args.group_pages)
    vocab = model.config.vocab_size
    # Warm-up: kernels compiled, grads allocated. Six chunks, so that the last reads 5 chunks of
    # earlier pages (160 at 4096 tokens): more than top-k's budget (64) and than one dense group of
    # pages (--group-pages, 1024 by default: the kernels' second group runs without the chunk's
    # own keys, a variant of its own); at most the first length (a longer one after it may still
    # compile that variant). With 8192 tokens the first timed step compiled those (~0.8 s at 32K, dense).
    warm = warm_up_tokens(args.lengths[0], args.chunk_size, 128, args.group_pages, 6)
    default = args.impl in DEFAULT_IMPLS  # builds (and warms up) its engine per length in reserve()
    if not default:
        t0 = time.perf_counter()
        # packed documents take kernel variants of their own: compiled here too
        packed = args.packed_docs if args.impl in OOMB_OFFLOAD else 0
        step(torch.randint(0, vocab, (1, warm), device=args.device),
             position_ids=packed_positions(warm, packed, args.device))
        print(f"[{args.impl}] warm-up step ({warm:,} tokens) {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        t0 = time.perf_counter()
        reserve(max(args.lengths))
        reserve_s = round(time.perf_counter() - t0, 1)
        print(f"[{args.impl}] reserve ({max(args.lengths):,} tokens) {reserve_s} s", file=sys.stderr, flush=True)
    for length in args.lengths:
        # the last length's reserve (a default impl's warm-up) and step, when asked: where the peak goes
        with memory_traced(cuda and bool(args.memory_trace) and length == args.lengths[-1], out=args.memory_trace):
            ok = measure(args, length, step, reserve, reserve_s if not default else None, model, info,
                         weights_gib, compile_layers, oomb_liger)
        if not ok:
            break


def measure(args, length, step, reserve, reserve_s, model, info, weights_gib, compile_layers, oomb_liger) -> bool:
    """One timed step of `length` tokens (reserved first for a default impl), its row recorded;
    False when it ran out of memory."""
    cuda, default, vocab = args.device == "cuda", args.impl in DEFAULT_IMPLS, model.config.vocab_size
    if default:
        t0 = time.perf_counter()
        reserve(length)
        reserve_s = round(time.perf_counter() - t0, 1)
    # the same tokens for every implementation, whatever its warm-up drew
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(args.device)
    positions = None
    if args.packed_docs:  # documents of packed_docs tokens: oomb masks each to itself, transformers
        # takes them as a batch of that many separate sequences
        if length % args.packed_docs:
            sys.exit(f"--packed-docs {args.packed_docs} does not divide the length {length}")
        positions = (torch.arange(length, device=args.device) % args.packed_docs)[None]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()  # alloc_retries of this step only
    t0 = time.perf_counter()
    row = {"bench": "step", "impl": args.impl, "model": args.model, "lora_rank": args.lora_rank,
           "seq_len": length, "layers": model.config.num_hidden_layers,
           "chunk_size": args.chunk_size if args.impl in OOMB_OFFLOAD else None,
           "kv_grad_dtype": args.kv_grad_dtype if args.impl in OOMB_OFFLOAD else None,
           "checkpoint_layers": args.checkpoint_layers if args.impl in OOMB_OFFLOAD else None,
           "liger": oomb_liger or args.impl == "liger", "compile": compile_layers, "float8": args.float8,
           "param_grad_dtype": args.param_grad_dtype if args.impl in OOMB_OFFLOAD else None,
           "keep_attention": args.keep_attention if args.impl in OOMB_OFFLOAD else None,
           "page_budget_gib": args.page_budget_gib if args.impl in OOMB_OFFLOAD else None,
           "group_pages": args.group_pages if args.impl in OOMB_OFFLOAD else None,
           "gpu_cap_gib": args.gpu_cap_gib, "packed_docs": args.packed_docs,
           "weights_gib": weights_gib and round(weights_gib, 2),
           "reserve_s": reserve_s if args.impl in OOMB_OFFLOAD else None}
    profile = args.profile and length == args.lengths[-1]
    meter = GpuMeter(cuda)
    try:
        window = profile and args.profile_passes and tuple(map(int, args.profile_passes.split(":")))
        with profiled(profile, args.profile, args.impl, window or None) as prof:
            clocks = []  # one per timed step: the last one's passes go in the row

            def progress(done: int, total: int) -> None:
                clocks[-1](done, total)
                if done == total or done % max(1, total // 20) == 0:  # a long step shows it is moving
                    print(f"[{args.impl} {length:,}] pass {done}/{total}, {time.perf_counter() - t0:.0f} s",
                          file=sys.stderr, flush=True)
                if window:
                    prof.step()
            times = []
            for _ in range(args.repeats):  # the same tokens each time, every gradient freed between
                t1 = time.perf_counter()
                clocks.append(PassClock(cuda))
                loss = float(step(ids, progress=progress, position_ids=positions))
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t1)
                if len(times) < args.repeats:
                    for p in model.parameters():
                        p.grad = None
        dt = statistics.median(times)
        row.update(ok=True, step_s=round(dt, 2), tok_s=round(length / dt, 1), loss=round(loss, 4),
                   **({"step_times": [round(t, 3) for t in times]} if args.repeats > 1 else {}),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                   # what the allocator held at most (the cap of --gpu-cap-gib bounds this)
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
                   # the caching allocator's cudaMalloc retries (it freed its cache and synchronised):
                   # a step that runs close to the GPU's capacity pays for each
                   alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else None,
                   # cudaMalloc calls during the step (the cache did not have a block): each costs
                   device_allocs=torch.cuda.memory_stats().get("num_device_alloc", 0) if cuda else None,
                   host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1),
                   **meter.summary())
        if hasattr(step, "engine"):
            row.update(engine_fields(step.engine()))
            row.update(clocks[-1].summary())
        if default:  # what oomb.auto chose, in the row's own fields
            e = step.engine().config
            row.update(chunk_size=e.chunk_size, kv_grad_dtype="bf16" if e.kv_grad_dtype == torch.bfloat16
                       else "fp32", checkpoint_layers=e.checkpoint_layers, compile=e.compile_layers,
                       keep_attention="fit", param_grad_dtype="fp32", auto=step.choice().summary())
    except torch.OutOfMemoryError as e:
        row.update(ok=False, error=str(e)[:160])
    finally:
        meter.stop()
    if profile and row["ok"]:
        row["profiled"] = True  # the profiler slows the step: this row's time is not comparable
        row["profile_passes"] = args.profile_passes or None
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    row.update(info)
    record(args.out, row)
    for p in model.parameters():
        p.grad = None
    if cuda:
        torch.cuda.empty_cache()
    return row["ok"]


TRAINER_IMPLS = {"oomb-train": 0, "oomb-sparse-train": 64}  # impl: its --sparse-budget


def trainer_row(args, impl: str, length: int, env: dict) -> dict:
    """`oomb train` as a user runs it (a child process, no tuning flags) for --train-steps steps
    at `length` tokens: its step times from metrics.jsonl (no checkpoints: --no-save)."""
    from oomb.presets import preset_config

    row = {"bench": "step", "impl": impl, "model": args.model, "lora_rank": args.lora_rank, "seq_len": length,
           "layers": preset_config(args.model).num_hidden_layers, "sparse_budget": TRAINER_IMPLS[impl],
           "train_steps": args.train_steps}
    info = run_info()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "oomb.cli", "train", "--model", args.model, "--seq-len", str(length),
               "--steps", str(args.train_steps), "--lora-rank", str(args.lora_rank), "--device", args.device,
               "--sparse-budget", str(TRAINER_IMPLS[impl]), "--output-dir", out, "--no-save",
               "--lr", "1e-5"]  # random weights: a small step keeps every loss finite (a skipped step logs no time)
        print(f"[{impl} {length:,}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {**row, "ok": False, "error": f"timeout {args.timeout}s", **info}
        sys.stdout.write(done.stdout)
        metrics = os.path.join(out, "metrics.jsonl")
        if os.path.exists(metrics):
            with open(metrics) as f:
                steps = logged_steps(f.read().splitlines())
        else:
            steps = []
    if done.returncode or len(steps) < args.train_steps:
        sys.stderr.write(done.stderr[-4000:])
        last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {**row, "ok": False, "error": last[0][:200], **info}
    times = [r["step_s"] for r in steps]
    step_s = statistics.median(times[1:] or times)
    chose = [line.removeprefix("oomb train: ") for line in done.stdout.splitlines()
             if line.startswith("oomb train: auto configuration")]
    return {**row, "ok": True, "step_s": step_s, "tok_s": round(length / step_s, 1), "trainer_step_s": times,
            "loss": steps[-1]["loss"], "peak_gib": max(r["peak_mem_gib"] for r in steps),
            "peak_reserved_gib": max((r.get("peak_reserved_gib") for r in steps if r.get("peak_reserved_gib")),
                                     default=None),
            "host_peak_gib": max(r.get("host_rss_gib", 0.0) for r in steps),
            "host_layers": steps[-1].get("host_layers"), **({"auto": chose[0]} if chose else {}), **info}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="oomb,liger,hf",
                    help="oomb, oomb-all, oomb-auto (offload modes), oomb-sparse[-all|-auto] (TopKPages(64)), "
                         "oomb-default, oomb-sparse-default (what oomb train chooses, dense or --sparse-budget 64: no "
                         "tuning flags apply), oomb-train, oomb-sparse-train (oomb train itself, optimizer "
                         "included), liger, hf")
    ap.add_argument("--lengths", default="32K,64K,128K,256K")
    ap.add_argument("--model", default="qwen2.5-7b", help="a preset of oomb.presets (qwen2.5-7b, gpt-oss-20b)")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters on attention, base frozen (0: full)")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step.jsonl"))
    ap.add_argument("--kv-grad-dtype", choices=sorted(GRAD_DTYPES), default="fp32", help="oomb's dK/dV pages")
    ap.add_argument("--checkpoint-layers", action="store_true", help="oomb: recompute each layer in backward")
    ap.add_argument("--oomb-liger", action="store_true", help="oomb: Liger's RMSNorm and SwiGLU in the model")
    ap.add_argument("--oomb-compile", action="store_true", help="oomb: torch.compile around attention (compile_layers)")
    ap.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none",
                    help="every impl: the decoder layers' projections as torchao float8 GEMMs (oomb.models.float8)")
    ap.add_argument("--keep-attention", nargs="?", const="yes", choices=sorted(KEEP), default="no",
                    help="oomb: stage 2 takes stage 1's attention outputs (keep_attention): yes (every layer, on the "
                         "GPU if they fit there, else on the host), fit (as many layers as fit), no")
    ap.add_argument("--kept-host-gib", type=float, default=None,
                    help="oomb: pinned host memory for kept attention outputs (default: half of what is free)")
    ap.add_argument("--param-grad-dtype", choices=["param", "fp32"], default="param",
                    help="oomb: sum parameter gradients over chunks in the weights' dtype or in fp32")
    ap.add_argument("--page-budget-gib", type=float, default=None,
                    help="oomb 'auto': GPU bytes for pages (default: what is free); fewer puts more layers on the host")
    ap.add_argument("--group-pages", type=int, default=1024,
                    help="oomb: pages per attention call (and per host transfer): ChunkRecurrentEngine(group_pages=)")
    ap.add_argument("--profile", default="", help="a directory: profile the last length's step into it")
    ap.add_argument("--profile-passes", default="", metavar="FIRST:COUNT",
                    help="oomb: profile only COUNT chunk passes after the FIRST (stage 1's n - 1 passes, then "
                         "stage 2's n): a steady-state sample of a long step (a 1M step's whole trace is too big)")
    ap.add_argument("--packed-docs", type=parse_tokens, default=0,
                    help="documents of this many tokens packed into each sequence: oomb steps them with position_ids "
                         "(each attends to itself), transformers as a batch of separate sequences")
    ap.add_argument("--gpu-cap-gib", type=float, default=None,
                    help="every impl: cap the process's GPU memory (torch.cuda.set_per_process_memory_fraction): "
                         "a smaller GPU's memory, not its speed")
    ap.add_argument("--memory-trace", default="", metavar="FILE",
                    help="record the GPU allocations of the last length's reserve and step (torch.cuda.memory "
                         "history) and print those live at its peak by the lines that made them; JSON into FILE")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (tests use it with --model tiny)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per implementation")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed steps per length (the row's step_s is their median; each is in step_times)")
    ap.add_argument("--train-steps", type=int, default=3,
                    help="oomb-train, oomb-sparse-train: the trainer's --steps (the first is not timed)")
    ap.add_argument("--impl", help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args()
    args.lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_step.py needs a CUDA GPU (or --device cpu for a smoke run of a small preset)")
    if args.impl:
        return worker(args)
    impls = args.impls.split(",")
    trainers = [i for i in impls if i in TRAINER_IMPLS]
    if trainers and (args.gpu_cap_gib is not None or args.layers is not None):
        sys.exit(f"{', '.join(trainers)} run oomb train on the whole GPU and the whole preset: leave them out of a "
                 "run with --gpu-cap-gib or --layers")
    if ("liger" in impls or args.oomb_liger) and importlib.util.find_spec("liger_kernel") is None:
        sys.exit("--impls liger and --oomb-liger need Liger's kernels: pip install liger-kernel (offline: "
                 "pip install --no-deps a liger_kernel wheel; they need only torch and triton)")
    for impl in impls:
        env = dict(os.environ)
        if impl.startswith("oomb"):  # as `oomb train` runs (oomb.cli.main)
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)
        if impl in TRAINER_IMPLS:
            for length in args.lengths:
                record(args.out, trainer_row(args, impl, length, env))
            continue
        cmd = [sys.executable, __file__, "--impl", impl, "--lengths", ",".join(map(str, args.lengths)),
               "--model", args.model, "--lora-rank", str(args.lora_rank), "--chunk-size", str(args.chunk_size),
               "--out", args.out, "--kv-grad-dtype", args.kv_grad_dtype, "--profile", args.profile,
               "--param-grad-dtype", args.param_grad_dtype, "--profile-passes", args.profile_passes,
               "--device", args.device, "--float8", args.float8, "--group-pages", str(args.group_pages),
               "--memory-trace", args.memory_trace, "--repeats", str(args.repeats)]
        if args.checkpoint_layers:
            cmd.append("--checkpoint-layers")
        if args.oomb_liger:
            cmd.append("--oomb-liger")
        if args.oomb_compile:
            cmd.append("--oomb-compile")
        cmd += ["--keep-attention", args.keep_attention]
        if args.kept_host_gib is not None:
            cmd += ["--kept-host-gib", str(args.kept_host_gib)]
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        if args.page_budget_gib is not None:
            cmd += ["--page-budget-gib", str(args.page_budget_gib)]
        if args.gpu_cap_gib is not None:
            cmd += ["--gpu-cap-gib", str(args.gpu_cap_gib)]
        if args.packed_docs:
            cmd += ["--packed-docs", str(args.packed_docs)]
        try:
            subprocess.run(cmd, timeout=args.timeout, env=env)  # the worker prints and appends its rows
        except subprocess.TimeoutExpired:
            print(json.dumps({"bench": "step", "impl": impl, "ok": False, "error": f"timeout {args.timeout}s"}),
                  flush=True)


if __name__ == "__main__":
    main()
