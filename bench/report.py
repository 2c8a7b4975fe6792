"""docs/benchmarks.md and its plots, generated from the rows in bench/results/*.jsonl.

    python bench/report.py                                # docs/benchmarks.md and docs/*.png
    python bench/report.py --results DIR --out-dir DIR    # other rows, written elsewhere

Each section answers one question with rows that measured the main line's code, picked by
the rule written under its table; every row names its commit, date and the command that
reproduces it (rebuilt from the settings the row records). The results files keep every row,
those of earlier code included: a new measurement is a new row, and the page follows it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
H200_GIB = 139.8  # what torch reports for the H200s the rows ran on

STEP_IMPLS = {"oomb", "oomb-all", "oomb-auto", "oomb-sparse", "oomb-sparse-all", "oomb-sparse-auto", "oomb-default",
              "oomb-sparse-default", "liger", "hf"}
ATTENTION_IMPL = re.compile(r"paged(-sparse\d+)?|sdpa_cudnn|sdpa_flash")
PARALLEL_IMPLS = {"dense", "sparse"}
OFFLOAD = {"oomb": "none", "oomb-all": "all", "oomb-auto": "auto",
           "oomb-sparse": "none", "oomb-sparse-all": "all", "oomb-sparse-auto": "auto", "oomb-default": "auto",
           "oomb-sparse-default": "auto"}
DEFAULT_IMPLS = {"oomb-default", "oomb-sparse-default"}  # what oomb train chooses (oomb.auto)
TRAINER_IMPLS = {"oomb-train": "oomb-default", "oomb-sparse-train": "oomb-sparse-default"}  # and its engine-only step
PRESET_LAYERS = {"qwen2.5-7b": 28, "qwen2.5-3b": 36, "qwen2.5-1.5b": 28, "gpt-oss-20b": 24}
PLAN_HOST_GIB = 110  # what `oomb plan` assumes a 128 GiB machine leaves for pinned pages
BASELINES = {"liger": "transformers + Liger", "hf": "transformers"}

SECTIONS = ["Kernels vs cuDNN", "Dense step vs transformers and Liger", "The trainer end to end", "GPU memory vs context",
            "Top-k sparse steps",
            "Offload overhead", "Longest context", "Smaller GPUs", "Packed documents", "GPT-OSS", "Several GPUs",
            "Long runs and sanitizers", "Before and after a change", "How to reproduce"]


# --- rows -------------------------------------------------------------------------------------

def load(results: str, name: str) -> list[dict]:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def shipped(r: dict, is_impl) -> bool:
    """A row that measured the main line's code: the implementation name a bench script writes
    (A/B arms and reverted variants were given another by hand), from a commit of the main line
    (`merged: false` marks the others), with no environment switch changing the code path, not
    profiled (the profiler slows a step), not excluded (a disturbed run), on a GPU."""
    return (bool(is_impl(r.get("impl", ""))) and r.get("merged", True) and not r.get("switches")
            and not r.get("env") and not r.get("profiled") and not r.get("excluded")
            and not r.get("fused_weight_grads") and r.get("gpu", "cpu") != "cpu")


def step_rows(rows: list[dict]) -> list[dict]:
    """Shipped step rows that finished on a whole GPU with one document a sequence, each marked
    with whether its peak memory is its own (a row whose process capped its GPU memory emulates
    a smaller GPU; packed documents are a step of another cost)."""
    return [r for r in own_peaks(rows) if shipped(r, STEP_IMPLS.__contains__) and r.get("ok")
            and not r.get("gpu_cap_gib") and not r.get("packed_docs")]


def own_peaks(rows: list[dict]) -> list[dict]:
    """Each row with `own_peak`: bench_step.py reserves the engine's pages for the longest length
    of its process before the first step (rows since then carry reserve_s), so in such a process
    only the longest length's peak is that length's own; transformers reserves nothing."""
    longest = defaultdict(int)
    for r in rows:
        key = (r["commit"], r["date"], r["impl"])
        longest[key] = max(longest[key], r["seq_len"])
    return [{**r, "own_peak": r.get("peak_gib") is not None and not r.get("peak_note")
             and (r.get("reserve_s") is None or r["seq_len"] == longest[(r["commit"], r["date"], r["impl"])])}
            for r in rows]


def base_options(r: dict, model: str = "qwen2.5-7b") -> bool:
    """The preset model whole, bf16 weights, the bench scripts' default precision (or oomb train's,
    for what it chooses) and page budget."""
    return (r.get("model", "qwen2.5-7b") == model and r.get("layers") == PRESET_LAYERS[model]
            and r.get("float8", "none") == "none"
            and (r.get("param_grad_dtype") != "fp32" or r["impl"] in DEFAULT_IMPLS)  # fp32 sums: oomb train's
            and r.get("page_budget_gib") is None and not (r["impl"] in OFFLOAD and r.get("liger")))


def kept(r: dict) -> bool:
    """Stage 2 took stage 1's attention outputs (keep_attention) for at least one layer."""
    if "kept_layers" in r:
        return r["kept_layers"] > 0
    return r.get("keep_attention") in (True, "yes")


def newest(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["date"])


def newest_each(rows, key) -> list[dict]:
    """The newest row of each group of `rows` with the same key(row)."""
    groups = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    return [newest(g) for g in groups.values()]


# --- formatting -------------------------------------------------------------------------------

def tokens(n: int) -> str:
    return f"{n // 1024}K" if n < 2**20 else f"{n / 2**20:g}M"


def commit(r: dict) -> str:
    return r["commit"][:7]


def day(r: dict) -> str:
    return r["date"][:10]


def num(x, spec: str = ",.0f") -> str:
    return "—" if x is None else format(x, spec)


def peak(r: dict) -> str:
    return num(r.get("peak_gib"), ".1f") if r.get("own_peak", True) else "—"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Commands:
    """The commands of one table's rows, numbered in the order the table first cites them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def ref(self, cmd: str) -> str:
        if cmd not in self.lines:
            self.lines.append(cmd)
        return f"[{self.lines.index(cmd) + 1}]"

    def render(self) -> str:
        return "\n".join(f"- [{i}] `{c}`" for i, c in enumerate(self.lines, 1))


# The engine switches a step row records: (field, value that turns it on (True: any true value),
# in words, as a bench_step.py flag).
SWITCHES = [("kv_grad_dtype", "bf16", "bf16 dK/dV", "--kv-grad-dtype bf16"),
            ("checkpoint_layers", True, "checkpoint_layers", "--checkpoint-layers"),
            ("compile", True, "compiled", "--oomb-compile"),
            ("liger", True, "Liger RMSNorm/SwiGLU", "--oomb-liger")]


def switches_on(r: dict) -> list[tuple]:
    return [sw for sw in SWITCHES if (bool(r.get(sw[0])) if sw[1] is True else r.get(sw[0]) == sw[1])]


def section(what: str, out: list, cmds: "Commands", *paragraphs: str) -> str:
    """A section's paragraphs (its table among them) and then the commands its rows cite, or a line
    saying that no row measured it."""
    if not out:
        return f"_No {what} rows._"
    return "\n\n".join([*paragraphs, cmds.render()])


def step_settings(r: dict) -> str:
    """The settings that set a step's time and memory, in words."""
    s = []
    if r["impl"] in DEFAULT_IMPLS:
        s.append("oomb train's choice (memory for AdamW's state kept free)")
    if r["impl"] in OFFLOAD:
        s.append(f"chunk {r['chunk_size']}")
        s += [words for _, _, words, _ in switches_on(r)]
        if kept(r):
            s.append(kept_text(r))
        if r.get("host_layers") and OFFLOAD[r["impl"]] == "auto":
            s.append(f"{r['host_layers']} layers' pages on the host")
        if r.get("param_grad_dtype") == "fp32":
            s.append("fp32 gradient sums")
    if r.get("float8", "none") != "none":
        s.append(f"float8 {r['float8']}")
    if r.get("lora_rank"):
        s.append(f"LoRA r={r['lora_rank']}")
    return ", ".join(s) or "defaults"


def kept_text(r: dict) -> str:
    where = r.get("kept_where", "gpu")
    if where == "gpu+host":
        where = f"{r['kept_layers'] - r['kept_host_layers']} on the GPU, {r['kept_host_layers']} on the host"
    else:
        where = "on the GPU" if where == "gpu" else "on the host"
    return f"outputs of {r.get('kept_layers', 'all')} layers kept {where}"


# --- commands rebuilt from a row's settings ---------------------------------------------------

def step_command(r: dict) -> str:
    """bench_step.py (or bench_offload.py, whose rows compare gradients) with the flags that give
    the row's recorded settings; settings a row does not record were its commit's defaults."""
    if any(k in r for k in ("grads_equal_first", "grads_equal_first_mode", "grad_max_rel_err_vs_first")):
        return offload_command(r)
    model = r.get("model", "qwen2.5-7b")
    parts = ["python bench/bench_step.py", f"--impls {r['impl']}", f"--lengths {tokens(r['seq_len'])}"]
    if model != "qwen2.5-7b":
        parts.append(f"--model {model}")
    if r.get("lora_rank"):
        parts.append(f"--lora-rank {r['lora_rank']}")
    if r.get("layers") != PRESET_LAYERS.get(model, r.get("layers")):
        parts.append(f"--layers {r['layers']}")
    if r.get("float8", "none") != "none":
        parts.append(f"--float8 {r['float8']}")
    if r["impl"] in OFFLOAD and r["impl"] not in DEFAULT_IMPLS:  # the defaults take no engine flags
        parts += step_engine_flags(r)
    if r.get("packed_docs"):
        parts.append(f"--packed-docs {tokens(r['packed_docs'])}")
    if r.get("gpu_cap_gib"):
        parts.append(f"--gpu-cap-gib {r['gpu_cap_gib']:g}")
    if r.get("train_steps", 3) != 3:
        parts.append(f"--train-steps {r['train_steps']}")
    if len(r.get("step_times", ())) > 1:
        parts.append(f"--repeats {len(r['step_times'])}")
    return " ".join(parts)


def step_engine_flags(r: dict) -> list[str]:
    flags = []
    if r.get("chunk_size") != 4096:
        flags.append(f"--chunk-size {r['chunk_size']}")
    flags += [flag for _, _, _, flag in switches_on(r)]
    if r.get("param_grad_dtype") == "fp32":
        flags.append("--param-grad-dtype fp32")
    keep = "yes" if r.get("keep_attention") is True else r.get("keep_attention")
    if keep in ("yes", "fit"):
        flags.append(f"--keep-attention {keep}")
    if r.get("kept_host_gib") and "host" in r.get("kept_where", ""):  # the arena they took, rounded up
        flags.append(f"--kept-host-gib {math.ceil(r['kept_host_gib'])}")
    if r.get("page_budget_gib") is not None:
        flags.append(f"--page-budget-gib {r['page_budget_gib']:g}")
    if r.get("group_pages") not in (None, 1024):
        flags.append(f"--group-pages {r['group_pages']}")
    return flags


def offload_command(r: dict) -> str:
    parts = ["python bench/bench_offload.py", f"--modes {OFFLOAD[r['impl']]}", f"--lengths {tokens(r['seq_len'])}"]
    if r.get("chunk_size") != 4096:
        parts.append(f"--chunk-size {r['chunk_size']}")
    if r.get("kv_grad_dtype") == "bf16":
        parts.append("--kv-grad-dtypes bf16")
    if r.get("layers") != PRESET_LAYERS.get(r.get("model", "qwen2.5-7b")):
        parts.append(f"--layers {r['layers']}")
    return " ".join(parts)


def attention_command(r: dict) -> str:
    parts = ["python bench/bench_attention.py", f"--keys {r['N']}"]
    if r.get("C", 4096) != 4096:
        parts.append(f"--queries {r['C']}")
    if r.get("sparse_budget"):
        parts += [f"--sparse {r['sparse_budget']}", "--no-sdpa"]
        if r.get("chunk_budget", 256) != 256:
            parts.append(f"--chunk-budget {r['chunk_budget']}")
    if r.get("kernels_ms"):
        parts.append("--kernels")
    return " ".join(parts)


def parallel_command(r: dict) -> str:
    parts = [f"torchrun --nproc-per-node {r['world']} bench/bench_parallel.py", f"--tp {r['tp']}",
             f"--lengths {tokens(r['seq_len'])}", f"--impls {r['impl']}"]
    if r.get("model", "qwen2.5-7b") != "qwen2.5-7b":
        parts.append(f"--model {r['model']}")
    if r.get("layers") != PRESET_LAYERS.get(r.get("model", "qwen2.5-7b"), r.get("layers")):
        parts.append(f"--layers {r['layers']}")
    if r.get("compile"):
        parts.append("--compile")
    if r.get("kv_grad_dtype") == "bf16":
        parts.append("--kv-grad-dtype bf16")
    if r.get("chunk_size", 4096) != 4096:
        parts.append(f"--chunk-size {r['chunk_size']}")
    if r.get("group_pages") not in (None, 1024):
        parts.append(f"--group-pages {r['group_pages']}")
    if r.get("keep_attention") not in (None, "no"):
        parts.append(f"--keep-attention {r['keep_attention']}")
    if r.get("offload", "auto") != "auto":
        parts.append(f"--offload {r['offload']}")
    if r.get("gpu") == "cpu":
        parts.append("--device cpu")
    return " ".join(parts)


# --- kernels ----------------------------------------------------------------------------------

def select_kernels(rows: list[dict]) -> list[dict]:
    """For each key count: the newest bench_attention.py invocation (commit and date) that timed the
    paged kernels beside cuDNN there (dense), and the newest that timed the top-k kernels there.
    Returns one entry per (kind, keys) with that invocation's row of each implementation."""
    rows = [r for r in rows if shipped(r, ATTENTION_IMPL.fullmatch) and "error" not in r
            and r.get("fwd_ms") and r.get("bwd_ms")]
    runs = defaultdict(lambda: defaultdict(dict))  # (kind, keys) -> invocation -> impl -> row
    for r in rows:
        kind = "dense" if r["impl"] in ("paged", "sdpa_cudnn", "sdpa_flash") else r["impl"]
        runs[(kind, r["N"])][(r["commit"], r["date"])][r["impl"]] = r
    picked = []
    for (kind, n), by_run in runs.items():
        need = {"paged", "sdpa_cudnn"} if kind == "dense" else {kind}
        complete = [run for run in by_run.values() if need <= set(run)]
        if complete:
            picked.append({"kind": kind, "N": n, **max(complete, key=lambda run: newest(list(run.values()))["date"])})
    return sorted(picked, key=lambda e: (e["kind"] != "dense", e["kind"], e["N"]))


def kernels_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for e in select_kernels(rows):
        paged = e["paged" if e["kind"] == "dense" else e["kind"]]
        cudnn, flash = e.get("sdpa_cudnn"), e.get("sdpa_flash")
        what = "dense" if e["kind"] == "dense" else f"top-k {paged.get('sparse_budget')} pages"

        def pair(r, key="tflops"):
            return "—" if r is None else f"{r['fwd_' + key]:.0f} / {r['bwd_' + key]:.0f}"

        ratio = "—" if cudnn is None else (f"{paged['fwd_tflops'] / cudnn['fwd_tflops']:.2f} / "
                                           f"{paged['bwd_tflops'] / cudnn['bwd_tflops']:.2f}")
        out.append([tokens(e["N"]), what, pair(paged), f"{paged['fwd_ms']:.2f} / {paged['bwd_ms']:.2f}", pair(cudnn),
                    ratio, pair(flash), commit(paged), day(paged), cmds.ref(attention_command(paged))])
    return section("kernel", out, cmds,
        "4,096 queries (28 heads, 4 KV heads, head_dim 128, bf16, pages of 128 keys) against N earlier keys, "
        "forward and backward timed apart (`bench/bench_attention.py`). The paged kernel also computes the "
        "chunk's own causal part, counted in its FLOPs; SDPA (cuDNN, and FlashAttention-2 as `sdpa_flash`) runs "
        "non-causal over contiguous K/V of the earlier keys. Backward FLOPs are 2.5x the forward's. Top-k rows "
        "count the selected keys only; SDPA has no top-k.",
        table(["keys", "attention", "paged TFLOP/s fwd / bwd", "paged ms fwd / bwd", "cuDNN TFLOP/s fwd / bwd",
               "paged ÷ cuDNN fwd / bwd", "FA2 TFLOP/s fwd / bwd", "commit", "date", "command"], out),
        "Rows: for each key count, the newest `bench_attention.py` run that timed the paged kernels beside "
        "cuDNN (dense) or the top-k kernels alone; the ratio compares rows of the same run.")


# --- dense step -------------------------------------------------------------------------------

def select_dense_steps(rows: list[dict]) -> list[tuple[dict, dict]]:
    """For each context and each of tuned (offload 'none' with flags) and default (what oomb
    train chooses: oomb-default) dense oomb steps (the whole preset, full-parameter gradients):
    the newest run (commit and day) with such a step there; each such row of that run, with the
    run's transformers + Liger row there nearest in time (or None)."""
    rows = [r for r in step_rows(rows) if base_options(r) and not r.get("lora_rank")]
    pairs = []
    for n in sorted({r["seq_len"] for r in rows if r["impl"] in ("oomb", "oomb-default")}):
        for impl in ("oomb", "oomb-default"):
            at_n = [r for r in rows if r["impl"] == impl and r["seq_len"] == n]
            if not at_n:
                continue
            run = (commit(newest(at_n)), day(newest(at_n)))
            liger = [r for r in rows if r["impl"] == "liger" and r["seq_len"] == n and (commit(r), day(r)) == run]
            for r in sorted((r for r in at_n if (commit(r), day(r)) == run), key=lambda r: r["date"]):
                near = min(liger, key=lambda b: abs(minutes(b) - minutes(r)), default=None)
                pairs.append((r, near))
    return pairs


def minutes(r: dict) -> int:
    hh, mm = r["date"][11:13], r["date"][14:16]
    return int(hh) * 60 + int(mm)


def dense_step_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r, liger in select_dense_steps(rows):
        ref = cmds.ref(step_command(r)) + ("" if liger is None else ", " + cmds.ref(step_command(liger)))
        beside = (["—"] * 4 if liger is None else
                  [f"{liger['step_s']:.2f}", num(liger["tok_s"]), peak(liger), f"{liger['step_s'] / r['step_s']:.3f}"])
        out.append([tokens(r["seq_len"]), step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r), *beside,
                    commit(r), day(r), ref])
    hf = "" if any(r["impl"] == "hf" for r in step_rows(rows)) else (
        " No row measures transformers without Liger on a GPU (`--impls hf`).")
    return section("dense step", out, cmds,
        "One training step (forward and backward, no optimizer step) of the Qwen2.5-7B shape, full-parameter "
        "gradients, against transformers with SDPA, gradient checkpointing and Liger's Triton kernels "
        "(RoPE, RMSNorm, SwiGLU, fused linear cross entropy), each in its own process, one after the other in "
        "the same run." + hf,
        table(["context", "oomb settings", "oomb s", "oomb tok/s", "oomb peak GiB", "Liger s", "Liger tok/s",
               "Liger peak GiB", "oomb speed ÷ Liger", "commit", "date", "commands"], out),
        "Rows: for each context, the newest run (commit and day) that timed a tuned dense oomb step there (flags "
        "set by hand) and the newest that timed oomb train's own choice (oomb-default, no flags): each such oomb "
        "step, beside its run's Liger step nearest in time. oomb-default plans room for AdamW's state (bf16 "
        "moments: 28.4 GiB for the 7B), which neither the tuned steps nor Liger's hold. A peak shown as — was not "
        "the step's own (the process had reserved pages for a longer context).")


# --- the trainer end to end -------------------------------------------------------------------

def select_trainer(rows: list[dict]) -> list[tuple[dict, dict | None]]:
    """The newest `oomb train` row (oomb-train, oomb-sparse-train) of each kind, model, LoRA rank
    and context, with the engine-only step of the same choice there (oomb-default,
    oomb-sparse-default: the same model whole, on the whole GPU): the newest of the trainer's own
    commit, else the newest of any; or None."""
    runs = [r for r in rows if shipped(r, TRAINER_IMPLS.__contains__) and r.get("ok")]
    pairs = []
    for r in sorted(newest_each(runs, lambda r: (r["impl"], r["model"], r.get("lora_rank", 0), r["seq_len"])),
                    key=lambda r: (r["model"], r.get("lora_rank", 0), r["impl"], r["seq_len"])):
        engine = [e for e in step_rows(rows) if e["impl"] == TRAINER_IMPLS[r["impl"]] and e["seq_len"] == r["seq_len"]
                  and e.get("model", "qwen2.5-7b") == r["model"] and e.get("layers") == r["layers"]
                  and e.get("lora_rank", 0) == r.get("lora_rank", 0)]
        same = [e for e in engine if e.get("commit") == r.get("commit")]
        pairs.append((r, newest(same or engine) if engine else None))
    return pairs


def trainer_section(rows: list[dict]) -> str:
    cmds, out, pairs = Commands(), [], select_trainer(rows)
    if not pairs:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,oomb-train --lengths 64K` and "
                "`python bench/bench_step.py --impls oomb-sparse-default,oomb-sparse-train --lengths 1M` measure "
                "them._")
    for r, e in pairs:
        ref = cmds.ref(step_command(r)) + ("" if e is None else ", " + cmds.ref(step_command(e)))
        beside = ["—"] * 3 if e is None else [f"{e['step_s']:.2f}", commit(e), f"{e['step_s'] / r['step_s']:.3f}"]
        what = f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full"
        out.append([tokens(r["seq_len"]), f"{r['model']}, {what}", "top-k 64" if r.get("sparse_budget") else "dense",
                    str(len(r["trainer_step_s"])), f"{r['trainer_step_s'][0]:.2f}", f"{r['step_s']:.2f}",
                    num(r["tok_s"]), f"{r['peak_gib']:.1f}", *beside, commit(r), day(r), ref])
    return section("trainer", out, cmds,
        "`oomb train` itself, with no flags but the model, the context and top-k: each optimizer step as its "
        "metrics.jsonl logs it (the batch, forward and backward, gradient clipping, AdamW's step), the first "
        "(which compiles and warms up) apart from the median of the rest; beside it the engine-only step of "
        "the same automatic choice (forward and backward alone, the dense-step and top-k tables' oomb-default "
        "rows): the newest of the trainer's own commit, else the newest of any.",
        table(["context", "model", "attention", "steps", "first step s", "step s", "tok/s", "peak GiB",
               "engine-only step s", "its commit", "engine-only ÷ trainer", "commit", "date", "commands"], out))


# --- memory and tokens/s against the context --------------------------------------------------

MEMORY_MODES = [
    ("oomb dense, offload none", lambda r: r["impl"] == "oomb" and not kept(r)),
    ("oomb dense, offload none, attention outputs kept", lambda r: r["impl"] == "oomb" and kept(r)),
    ("oomb dense, offload all", lambda r: r["impl"] == "oomb-all" and not kept(r)),
    ("oomb dense, offload auto", lambda r: r["impl"] == "oomb-auto" and not kept(r)),
    ("oomb top-k, offload none", lambda r: r["impl"] == "oomb-sparse"),
    ("oomb top-k, offload auto", lambda r: r["impl"] == "oomb-sparse-auto" and not r.get("checkpoint_layers")),
    ("oomb top-k, offload all", lambda r: r["impl"] == "oomb-sparse-all" and not r.get("checkpoint_layers")
     and not kept(r)),
    ("oomb minimum memory (top-k, offload all, checkpoint_layers)",
     lambda r: r["impl"] == "oomb-sparse-all" and r.get("checkpoint_layers") and not kept(r)),
    ("transformers + Liger", lambda r: r["impl"] == "liger"),
    ("transformers", lambda r: r["impl"] == "hf"),
]


def select_memory(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """For each mode: the chunk size it was measured at most contexts (4096, the default, on a tie);
    at each context, the newest row at that chunk size whose peak is its own. (label, rows) per mode
    that has rows."""
    rows = [r for r in step_rows(rows) if base_options(r) and not r.get("lora_rank") and r["own_peak"]]
    picked = []
    for label, is_mode in MEMORY_MODES:
        mine = [r for r in rows if is_mode(r)]
        if not mine:
            continue
        contexts = defaultdict(set)
        for r in mine:
            contexts[r.get("chunk_size")].add(r["seq_len"])
        chunk = max(contexts, key=lambda c: (len(contexts[c]), c == 4096))
        at = defaultdict(list)
        for r in mine:
            if r.get("chunk_size") == chunk:
                at[r["seq_len"]].append(r)
        picked.append((label if chunk is None else f"{label}, chunk {chunk}", [newest(at[n]) for n in sorted(at)]))
    return picked


def memory_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for label, mine in select_memory(rows):
        for r in mine:
            out.append([label, tokens(r["seq_len"]), f"{r['peak_gib']:.1f}", f"{r['step_s']:.2f}", num(r["tok_s"]),
                        step_settings(r), commit(r), day(r), cmds.ref(step_command(r))])
    return section("step", out, cmds,
        "Peak GPU memory (`torch.cuda.max_memory_allocated`) and speed of one step of the Qwen2.5-7B shape, "
        "full-parameter gradients, by offload mode. 'none' keeps every page on the GPU; 'all' keeps them in "
        "pinned host memory and streams them through; 'auto' keeps layers' pages on the GPU while they fit and "
        "puts the other layers' pages on the host, so its peak follows the GPU's free memory. Top-k attends "
        "64 pages of 128 keys per block of queries (`TopKPages(budget=64)`).",
        "![Peak GPU memory against the context, one line per mode](memory_vs_context.png)",
        "![Tokens per second against the context, one line per mode](tokens_per_s_vs_context.png)",
        table(["mode", "context", "peak GiB", "s / step", "tok/s", "settings", "commit", "date", "command"], out),
        "Rows (and plotted points): for each mode, the chunk size it was measured at most contexts; at each "
        "context the newest row at that chunk size whose peak was its own (a process that ran several lengths "
        "reserved pages for the longest first, so only that length's peak counts). Both plots show these rows. "
        f"The dotted line is the H200's {H200_GIB} GiB; transformers is dashed.")


def context_axis(ax, lengths: set[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(lengths)
    ax.set_xticks(ticks)
    ax.set_xticklabels([tokens(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens, log scale)")
    ax.grid(True, alpha=0.3)


def plot_modes(modes: list[tuple[str, list[dict]]], field: str, ylabel: str, title: str, path: str,
               capacity: bool = False) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5.5))
    for i, (label, mine) in enumerate(modes):
        style = "--" if label.startswith("transformers") else "-"
        ax.plot([r["seq_len"] for r in mine], [r[field] for r in mine], style, marker="o", label=label,
                color=f"C{i}")
    if capacity:
        ax.axhline(H200_GIB, color="black", linestyle=":", linewidth=1, label=f"H200 memory ({H200_GIB} GiB)")
    context_axis(ax, {r["seq_len"] for _, mine in modes for r in mine} or {2**15})
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# --- top-k steps and where a 1M step's time goes ----------------------------------------------

def topk_label(r: dict) -> str:
    parts = [f"offload '{OFFLOAD[r['impl']]}'"]
    if r.get("checkpoint_layers"):
        parts.append("checkpoint_layers")
    if kept(r):
        parts.append("outputs kept")
    if r.get("float8", "none") != "none":
        parts.append(f"float8 {r['float8']}")
    if r.get("lora_rank"):
        parts.append(f"LoRA r={r['lora_rank']}")
    return ", ".join(parts)


def select_topk(rows: list[dict]) -> list[dict]:
    """Top-k steps of the Qwen2.5-7B shape at the default chunk 4096: the newest row of each
    configuration (offload mode, checkpoint_layers, kept outputs, float8, LoRA) at each context."""
    order = ["oomb-sparse-auto", "oomb-sparse-all", "oomb-sparse"]
    rows = [r for r in step_rows(rows) if r["impl"] in order and r.get("model", "qwen2.5-7b") == "qwen2.5-7b"
            and r.get("layers") == 28 and r.get("chunk_size") == 4096 and r.get("page_budget_gib") is None
            and r.get("param_grad_dtype") != "fp32"]
    picked = newest_each(rows, lambda r: (topk_label(r), r["seq_len"]))
    return sorted(picked, key=lambda r: (order.index(r["impl"]), bool(r.get("checkpoint_layers")),
                                         r.get("lora_rank") or 0, r.get("float8", "none"), kept(r), r["seq_len"]))


def topk_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_topk(rows):
        stages = ("—" if r.get("stage1_s") is None else f"{r['stage1_s']:.1f} / {r['stage2_s']:.1f}")
        out.append([topk_label(r), tokens(r["seq_len"]), f"{r['step_s']:.2f}", num(r["tok_s"]), stages, peak(r),
                    num(r.get("host_peak_gib"), ".1f"), step_settings(r), commit(r), day(r),
                    cmds.ref(step_command(r))])
    return section("top-k step", out, cmds,
        "One step with `TopKPages(budget=64)`: each block of 128 queries attends 64 pages of 128 keys (sinks "
        "included), chosen among the chunk's 256 candidate pages, so a chunk's attention does not grow with the "
        "context. Qwen2.5-7B shape, full-parameter gradients unless a row says LoRA, chunk 4096. Stage 1 runs the "
        "forward of chunks 0 .. n-2 and writes their pages; stage 2 runs each chunk again, last to first, "
        "forward and backward. Host GiB is the process's peak resident memory (pinned pages and kept outputs).",
        "![Where a 1M-token top-k step's time goes](step_1m_breakdown.png)",
        table(["configuration", "context", "s / step", "tok/s", "stage 1 / stage 2 s", "peak GPU GiB", "host GiB",
               "settings", "commit", "date", "command"], out),
        "Rows: for each configuration and context, the newest row. The plot splits the 1M rows that record "
        "their stages: seconds in each stage (CUDA events at each chunk pass, no synchronisation) and the mean "
        "milliseconds of a chunk pass by quarter of the sequence; the rows do not split the time by kernel.")


def plot_1m_breakdown(rows: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["seq_len"] == 2**20 and r.get("stage1_s") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.8 * max(len(mine), 3) + 2.5),
                                      gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{topk_label(r)}\n{commit(r)}, {day(r)}" for r in mine]
    y = list(range(len(mine)))
    s1 = [r["stage1_s"] for r in mine]
    s2 = [r["stage2_s"] for r in mine]
    rest = [max(r["step_s"] - a - b, 0) for r, a, b in zip(mine, s1, s2)]
    left.barh(y, s1, color="C0", label="stage 1: forward, pages written")
    left.barh(y, s2, left=s1, color="C1", label="stage 2: forward again + backward")
    left.barh(y, rest, left=[a + b for a, b in zip(s1, s2)], color="0.7", label="outside the chunk passes")
    for i, r in enumerate(mine):
        left.text(r["step_s"], i, f" {r['step_s']:.1f} s", va="center", fontsize=8)
    left.set_yticks(y)
    left.set_yticklabels(labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("seconds of one 1,048,576-token step")
    left.set_xlim(0, max((r["step_s"] for r in mine), default=1) * 1.18)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    left.set_title("Where a 1M-token top-k step's time goes")
    for i, r in enumerate(mine):
        q1, q2 = r.get("stage1_chunk_ms") or [], r.get("stage2_chunk_ms") or []
        right.plot(range(1, len(q2) + 1), q2, "-o", color=f"C{i + 2}", label=topk_label(r))
        right.plot(range(1, len(q1) + 1), q1, "--s", color=f"C{i + 2}")
    right.plot([], [], "-", color="0.3", label="(solid: stage 2, dashed: stage 1)")
    right.set_xticks([1, 2, 3, 4])
    right.set_xticklabels(["1st", "2nd", "3rd", "4th"])
    right.set_xlabel("quarter of the sequence (chunk position)")
    right.set_ylabel("ms per chunk pass (mean)")
    right.set_ylim(bottom=0)
    right.grid(True, alpha=0.3)
    right.legend(fontsize=7, loc="center right")
    right.set_title("A chunk pass by its position")
    if not mine:
        left.text(0.5, 0.5, "no 1M row records its stages", ha="center", transform=left.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# --- offload ----------------------------------------------------------------------------------

def same_settings(a: dict, b: dict) -> bool:
    keys = ("chunk_size", "kv_grad_dtype", "checkpoint_layers", "compile", "group_pages", "lora_rank")
    return all(a.get(k) == b.get(k) for k in keys) and kept(a) == kept(b) and ("sparse" in a["impl"]) == (
        "sparse" in b["impl"])


def select_offload(rows: list[dict]) -> list[tuple[dict, dict]]:
    """For each attention kind and context: the newest offload 'all' step; beside it, the newest
    step of the same settings that kept every page on the GPU ('none', or 'auto' that put no layer
    on the host), from the same run (commit and day) when there is one; else 'auto' with host layers."""
    rows = [r for r in step_rows(rows) if base_options(r) and r["impl"] in OFFLOAD]
    out = []
    for sparse in (False, True):
        alls = [r for r in rows if OFFLOAD[r["impl"]] == "all" and ("sparse" in r["impl"]) == sparse]
        for n in sorted({r["seq_len"] for r in alls}):
            a = newest([r for r in alls if r["seq_len"] == n])
            like = [r for r in rows if r["seq_len"] == n and OFFLOAD[r["impl"]] != "all" and same_settings(a, r)]
            on_gpu = [r for r in like if OFFLOAD[r["impl"]] == "none" or not r.get("host_layers")]
            for pool in (on_gpu, like):
                same_run = [r for r in pool if (commit(r), day(r)) == (commit(a), day(a))]
                if same_run or pool:
                    out.append((a, newest(same_run or pool)))
                    break
    return out


def offload_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for a, b in select_offload(rows):
        where = f"'{OFFLOAD[b['impl']]}'" + (f", {b['host_layers']} host layers" if b.get("host_layers") else "")
        out.append(["top-k" if "sparse" in a["impl"] else "dense", tokens(a["seq_len"]), f"{a['step_s']:.2f}",
                    peak(a), num(a.get("host_peak_gib"), ".1f"), where, f"{b['step_s']:.2f}", peak(b),
                    f"{a['step_s'] / b['step_s'] - 1:+.1%}", step_settings(a),
                    f"{commit(a)} / {commit(b)}", f"{day(a)} / {day(b)}",
                    f"{cmds.ref(step_command(a))}, {cmds.ref(step_command(b))}"])
    return section("offload", out, cmds,
        "Offload 'all' keeps every layer's K/V pages (and dK/dV) in pinned host memory, loading each layer's "
        "pages while the layer before it computes; the gradients equal those of 'none' bit for bit "
        "(`bench/bench_offload.py` checks it; `pytest -m gpu tests/test_gpu_engine.py` too).",
        table(["attention", "context", "'all' s", "'all' peak GiB", "'all' host GiB", "beside", "s", "peak GiB",
               "'all' overhead", "settings", "commits ('all' / beside)", "dates", "commands"], out),
        "Rows: for each attention kind and context, the newest 'all' step, beside the newest step of the same "
        "settings that kept every page on the GPU, from the same run when there is one (where none fits, as at "
        "1M, 'auto' with some layers on the host).")


# --- smaller GPUs ------------------------------------------------------------------------------

def select_gpu_sizes(rows: list[dict]) -> list[dict]:
    """Steps whose process capped its GPU memory (a smaller GPU's memory on the H200): for each
    cap, implementation, kind of gradients and attention, the longest context that finished."""
    capped = [r for r in own_peaks(rows) if shipped(r, STEP_IMPLS.__contains__) and r.get("ok")
              and r.get("gpu_cap_gib") and not r.get("packed_docs")]
    key = lambda r: (r["gpu_cap_gib"], r["impl"], r.get("lora_rank", 0), r.get("model", "qwen2.5-7b"))  # noqa: E731
    groups = defaultdict(list)
    for r in capped:
        groups[key(r)].append(r)
    picked = [newest([r for r in g if r["seq_len"] == max(x["seq_len"] for x in g)]) for g in groups.values()]
    return sorted(picked, key=key)


def gpu_label(r: dict) -> str:
    name = BASELINES.get(r["impl"], r["impl"])
    return f"{name}, {'LoRA r=' + str(r['lora_rank']) if r.get('lora_rank') else 'full'}"


def gpu_sizes_section(rows: list[dict], out_dir: str) -> str:
    cmds, out = Commands(), []
    picked = select_gpu_sizes(rows)
    longest = [auto_longest(r) if r["impl"] in DEFAULT_IMPLS else None for r in picked]  # the plan's, per row
    for r, reach in zip(picked, longest):
        planned = planned_peak(r) / 2**30 if r["impl"] in OFFLOAD else None
        out.append([f"{r['gpu_cap_gib']:g}", r.get("model", "qwen2.5-7b"), gpu_label(r), f"{r['seq_len']:,}",
                    f"{r['step_s']:.1f}", num(r["tok_s"]), peak(r), num(planned, ".2f"),
                    "—" if planned is None else f"{r['peak_gib'] / planned:.2f}", num(r.get("host_peak_gib"), ".1f"),
                    "—" if reach is None else f"{reach:,}",
                    step_settings(r) if r["impl"] in OFFLOAD else "gradient checkpointing", commit(r), day(r),
                    cmds.ref(step_command(r))])
    if not out:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,oomb-sparse-default,liger "
                "--lora-rank 16 --gpu-cap-gib 24 --lengths 128K,256K,512K,1M` (and 48, 80) measures them._")
    plot_gpu_sizes(picked, longest, os.path.join(out_dir, "longest_context_vs_gpu.png"))
    return section("capped step", out, cmds,
        "The longest context a step finished at with the process's GPU memory capped "
        "(`torch.cuda.set_per_process_memory_fraction`, `bench_step.py --gpu-cap-gib`) on an H200: a smaller "
        "GPU's memory, not its speed (its tokens/s are the H200's). oomb-default is what `oomb train` chooses "
        "for that memory with no tuning flags; transformers + Liger runs with gradient checkpointing. A "
        "transformers + Liger row is its limit (the next length ran out of memory); an oomb row is the longest "
        "length its run asked for, and the plot's dotted lines are the longest the plan fits (the table's "
        "plan's longest column).",
        "![Longest context against GPU memory](longest_context_vs_gpu.png)",
        table(["GPU GiB", "model", "implementation", "longest tokens", "s / step", "tok/s", "peak GPU GiB",
               "plan GiB", "peak ÷ plan", "host GiB", f"plan's longest (host {PLAN_HOST_GIB} GiB)", "settings",
               "commit", "date", "command"], out),
        "Rows: for each cap, implementation and kind of gradients, the longest context that finished; the newest "
        "row there (each run stops an implementation at its first length that does not fit). Plan: what "
        "`oomb plan` gives that step's GPU memory today, placed as its engine placed it (report.py planned_peak: "
        "weights, gradients, one chunk's working set, the pages of the layers on the GPU, staging, kept outputs "
        "on the GPU); a planned step keeps 5 % of the GPU (2 GiB at least) free beside it. Plan's longest: the "
        "longest context `oomb train` would choose settings for at that cap, by the plan, with AdamW's state "
        f"counted and {PLAN_HOST_GIB} GiB of host memory for pages (what a 128 GiB machine leaves); its most "
        "frugal setting (chunk 1024, bf16 dK/dV, layers recomputed) reaches it, so host memory, not the GPU, "
        "bounds it.",
        plan_summary(rows))


def plan_summary(rows: list[dict]) -> str:
    """One sentence: how the plan compares with every oomb step that records its placement."""
    checked = plan_checked(rows)
    if not checked:
        return ""
    ratios = [x for _, x in checked]
    return (f"Over all {len(checked)} oomb steps that record where their engine put pages and kept outputs "
            f"(whole and capped GPUs, {min(day(r) for r, _ in checked)} to {max(day(r) for r, _ in checked)}), the "
            f"measured peak is {min(ratios):.2f}x to {max(ratios):.2f}x of today's plan for it "
            "(tests/test_report.py holds it within 10 %).")


def select_packed(rows: list[dict]) -> list[tuple[dict, dict | None, dict | None]]:
    """For each (context, document length) an oomb step of packed documents measured at (whole
    GPU): the newest oomb row, the transformers + Liger row of its run there (the same documents
    as a batch of separate sequences), and the newest dense oomb row of the same implementation
    at that context (one document the length of the sequence), or None."""
    rows = [r for r in own_peaks(rows) if shipped(r, STEP_IMPLS.__contains__) and r.get("ok")
            and not r.get("gpu_cap_gib") and not r.get("lora_rank")]
    packed = [r for r in rows if r.get("packed_docs")]
    picked = []
    for key in sorted({(r["seq_len"], r["packed_docs"]) for r in packed if r["impl"] in OFFLOAD}):
        mine = newest([r for r in packed if (r["seq_len"], r["packed_docs"]) == key and r["impl"] in OFFLOAD])
        liger = [r for r in packed if (r["seq_len"], r["packed_docs"]) == key and r["impl"] == "liger"
                 and (commit(r), day(r)) == (commit(mine), day(mine))]
        dense = [r for r in step_rows(rows) if r["impl"] == mine["impl"] and r["seq_len"] == key[0]]
        picked.append((mine, newest(liger) if liger else None, newest(dense) if dense else None))
    return picked


def packed_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r, liger, dense in select_packed(rows):
        out.append([tokens(r["seq_len"]), tokens(r["packed_docs"]), r["seq_len"] // r["packed_docs"],
                    step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r),
                    "—" if liger is None else f"{liger['step_s']:.2f}", "—" if liger is None else peak(liger),
                    "—" if liger is None else f"{liger['step_s'] / r['step_s']:.2f}",
                    "—" if dense is None else f"{dense['step_s']:.2f}",
                    "—" if dense is None else f"{dense['step_s'] / r['step_s']:.2f}", commit(r), day(r),
                    ", ".join(cmds.ref(step_command(x)) for x in (r, liger, dense) if x is not None)])
    if not out:
        return ("_No rows yet: `python bench/bench_step.py --impls oomb-default,liger --lengths 128K --packed-docs 8K` "
                "and `python bench/bench_step.py --impls oomb-default,liger --lengths 128K` measure them._")
    return section("packed step", out, cmds,
        "One training step over sequences packed from documents of equal length (Qwen2.5-7B shape, full-parameter "
        "gradients): oomb takes the packed sequence with `position_ids` restarting at each document, so each "
        "document attends to itself only and the kernels skip the pages and key tiles of earlier documents; "
        "transformers + Liger takes the same documents as a batch of separate sequences; the dense oomb step "
        "is one document as long as the sequence (causal attention over all of it).",
        table(["context", "document", "documents", "oomb settings", "oomb s", "oomb tok/s", "oomb peak GiB",
               "Liger s (batch)", "Liger peak GiB", "oomb speed ÷ Liger", "oomb dense s", "dense ÷ packed",
               "commit", "date", "commands"], out),
        "Rows: for each context and document length, the newest packed oomb step, its run's Liger step, and the "
        "newest dense step of the same oomb implementation at that context.")


def plot_gpu_sizes(rows: list[dict], longest: list[int | None], path: str) -> None:
    """Each implementation's measured context against the cap; beside each oomb-default line, the
    longest context the plan fits (`longest`, a row's auto_longest or None)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    lines = defaultdict(list)
    for r in rows:
        lines[gpu_label(r)].append((r["gpu_cap_gib"], r["seq_len"]))
    planned = defaultdict(list)  # oomb train's choice: the longest context the plan fits at each cap
    for r, reach in zip(rows, longest):
        if reach is not None:
            planned[gpu_label(r)].append((r["gpu_cap_gib"], reach))
    for i, (label, points) in enumerate(sorted(lines.items())):
        points.sort()
        style = "--" if label.startswith("transformers") else "-"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label, color=f"C{i}")
        if label in planned:
            points = sorted(planned[label])
            ax.plot([p[0] for p in points], [p[1] for p in points], ":", marker="x", color=f"C{i}",
                    label=f"{label}: the plan's longest (host {PLAN_HOST_GIB} GiB)")
    ax.set_xlabel("GPU memory (GiB, the process's cap on an H200)")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("context (tokens)")
    ax.set_title("Context of a training step against GPU memory: measured (o), planned (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# --- longest context, GPT-OSS -----------------------------------------------------------------

def select_longest(rows: list[dict]) -> list[dict]:
    """For each model, kind of gradients (full or LoRA) and attention (dense or top-k): the longest
    context an oomb step finished at, the newest row there."""
    rows = [r for r in step_rows(rows) if r["impl"] in OFFLOAD
            and r.get("layers") == PRESET_LAYERS.get(r.get("model", "qwen2.5-7b"))]
    groups = defaultdict(list)
    for r in rows:
        groups[(r.get("model", "qwen2.5-7b"), bool(r.get("lora_rank")), "sparse" in r["impl"])].append(r)
    picked = []
    for g in groups.values():
        longest = max(r["seq_len"] for r in g)
        picked.append(newest([r for r in g if r["seq_len"] == longest]))
    return sorted(picked, key=lambda r: (r.get("model", "qwen2.5-7b") != "qwen2.5-7b", r.get("model", "qwen2.5-7b"),
                                         bool(r.get("lora_rank")), "sparse" in r["impl"]))


def row_engine(r: dict):
    """(model config, EngineConfig, trainable parameters or None) of an oomb row's step."""
    import torch

    from oomb.attention.sparse import TopKPages
    from oomb.config import EngineConfig
    from oomb.plan import lora_params
    from oomb.presets import preset_config

    config = preset_config(r.get("model", "qwen2.5-7b"))
    engine = EngineConfig(chunk_size=r["chunk_size"], offload=OFFLOAD[r["impl"]],
                          sparse=TopKPages(budget=64) if "sparse" in r["impl"] else None,
                          kv_grad_dtype=torch.bfloat16 if r.get("kv_grad_dtype") == "bf16" else torch.float32,
                          checkpoint_layers=bool(r.get("checkpoint_layers")), compile_layers=bool(r.get("compile")),
                          param_grad_dtype=torch.float32 if r.get("param_grad_dtype") == "fp32" else None,
                          group_pages=r.get("group_pages") or 1024, keep_attention=False)
    return config, engine, lora_params(config, r["lora_rank"]) if r.get("lora_rank") else None


def planned_longest(r: dict) -> int:
    """The longest context `oomb plan` says a step of row r's model and settings fits on one H200
    with PLAN_HOST_GIB of host memory (gradients only, as bench_step.py's step)."""
    from oomb.plan import longest_context, place, plan

    config, engine, trainable = row_engine(r)

    def fits(n: int) -> bool:
        p = plan(config, n, engine=engine, trainable_params=trainable, optimizer_bytes_per_param=0)
        return place(p, engine.offload, int(H200_GIB * 2**30), PLAN_HOST_GIB * 2**30).fits
    return longest_context(fits, engine.chunk_size)


def plan_checked(rows: list[dict]) -> list[tuple[dict, float]]:
    """(row, measured peak ÷ planned_peak) for every shipped oomb step with its own peak that
    records where its engine placed the pages and kept outputs (kept_host_layers), at a preset's
    full depth, one document a sequence."""
    picked = [r for r in own_peaks(rows) if shipped(r, OFFLOAD.__contains__) and r.get("ok")
              and r.get("own_peak", True) and r.get("peak_gib") and "kept_host_layers" in r
              and r.get("layers") == PRESET_LAYERS.get(r.get("model", "qwen2.5-7b")) and not r.get("packed_docs")]
    return [(r, r["peak_gib"] * 2**30 / planned_peak(r)) for r in picked]


def auto_longest(r: dict) -> int:
    """The longest context `oomb train`'s automatic configuration reaches for an oomb-default row's
    model, gradients and attention at its GPU cap, with PLAN_HOST_GIB of host memory and AdamW's
    state counted (as oomb train plans): that of its most frugal setting (oomb.auto.frugal)."""
    from oomb.auto import Machine, frugal, judge
    from oomb.plan import longest_context

    config, engine, trainable = row_engine(r)
    machine = Machine(int(r["gpu_cap_gib"] * 2**30), PLAN_HOST_GIB * 2**30)
    least = frugal(engine.replace(keep_attention=None), r["seq_len"])
    args = {"trainable_params": trainable}
    return longest_context(lambda n: judge(config, n, 1, least, machine, args)[1].fits, least.chunk_size)


def planned_peak(r: dict) -> int:
    """The GPU bytes `oomb plan` gives the step an oomb row measured, placed as its engine placed it
    (the row's layers on the host and kept outputs on the GPU): weights, gradients (no optimizer:
    bench_step.py's step has none), one chunk's working set, sparse selections, the device layers'
    pages, staging buffers when layers are on the host, and the kept attention outputs on the GPU."""
    from oomb.plan import plan

    config, engine, trainable = row_engine(r)
    p = plan(config, r["seq_len"], engine=engine.replace(keep_attention=True), trainable_params=trainable,
             optimizer_bytes_per_param=0)
    host = r.get("host_layers") or 0
    kept_gpu = (r.get("kept_layers") or 0) - (r.get("kept_host_layers") or 0)
    return (p.beside_pages + p.window_pages + (p.full_layers - host) * p.layer_bytes + (p.staging if host else 0)
            + kept_gpu * p.kept_layer_bytes)


def longest_section(rows: list[dict]) -> str:
    cmds, out, planned = Commands(), [], []
    for r in select_longest(rows):
        if r.get("model", "qwen2.5-7b").startswith("qwen2.5"):
            longest = planned_longest(r)
            planned.append([r.get("model", "qwen2.5-7b"), f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full",
                            "top-k" if "sparse" in r["impl"] else "dense", f"'{OFFLOAD[r['impl']]}', " + step_settings(r),
                            f"{longest:,}", f"{r['seq_len']:,}", peak(r), f"{100 * r['peak_gib'] / H200_GIB:.1f} %"
                            if r.get("peak_gib") else "—", commit(r), day(r), cmds.ref(step_command(r))])
        out.append([r.get("model", "qwen2.5-7b"), f"LoRA r={r['lora_rank']}" if r.get("lora_rank") else "full",
                    "top-k" if "sparse" in r["impl"] else "dense", f"{r['seq_len']:,}", f"{r['step_s']:.1f}",
                    num(r["tok_s"]), peak(r), num(r.get("host_peak_gib"), ".1f"), f"'{OFFLOAD[r['impl']]}', "
                    + step_settings(r), commit(r), day(r), cmds.ref(step_command(r))])
    measured = {row[0] for row in planned}
    topk = {"impl": "oomb-sparse-auto", "chunk_size": 4096, "kv_grad_dtype": "bf16", "checkpoint_layers": True}
    unmeasured = ", ".join(f"{model} {planned_longest({**topk, 'model': model}):,} tokens"
                           for model in ("qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b") if model not in measured)
    return section("step", out, cmds,
        "The longest context a measured step reached, per model, kind of gradients and attention. "
        "`oomb plan --seq-len N` estimates the GPU and host memory of other lengths before a run.",
        table(["model", "gradients", "attention", "tokens", "s / step", "tok/s", "peak GPU GiB", "host GiB",
               "offload, settings", "commit", "date", "command"], out),
        "Rows: for each model, kind of gradients and attention, the longest context among the rows; the "
        "newest row there.",
        f"The plan beside the measurement: the longest context `oomb plan` says each of those steps fits on one H200 "
        f"({H200_GIB} GiB, 5 % of it left free) with {PLAN_HOST_GIB} GiB of pinned host memory (gradients only, as "
        "the measured step; `oomb plan --model M --seq-len N --optimizer none` with the row's settings), computed "
        "from the code of this page's commit.",
        table(["model", "gradients", "attention", "offload, settings", "plan: longest tokens", "measured tokens",
               "measured peak GPU GiB", "of the GPU", "commit", "date", "command"], planned)
        + (f"\n\nShapes no step has measured, planned with full-parameter gradients, top-k, 'auto', chunk 4096, "
           f"bf16 dK/dV and layers recomputed: {unmeasured}." if unmeasured else ""))


def select_gpt_oss(rows: list[dict]) -> list[dict]:
    """GPT-OSS-20B steps: the newest row of each implementation and settings at each context."""
    rows = [r for r in step_rows(rows) if r.get("model") == "gpt-oss-20b"]
    return sorted(newest_each(rows, lambda r: (r["impl"], step_settings(r), r["seq_len"])),
                  key=lambda r: (r["impl"], r["seq_len"]))


def gpt_oss_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_gpt_oss(rows):
        out.append([tokens(r["seq_len"]), r["impl"], step_settings(r), f"{r['step_s']:.2f}", num(r["tok_s"]), peak(r),
                    num(r.get("host_peak_gib"), ".1f"), commit(r), day(r), cmds.ref(step_command(r))])
    return section("GPT-OSS", out, cmds,
        "GPT-OSS-20B shape (24 layers, mixture of experts, sliding-window layers between full-attention ones), "
        "random bf16 weights, LoRA adapters on attention with the base frozen; top-k on the full-attention layers, "
        "while each sliding-window layer keeps one page per chunk.",
        table(["context", "implementation", "settings", "s / step", "tok/s", "peak GPU GiB", "host GiB", "commit",
               "date", "command"], out),
        "Rows: the newest row of each implementation and settings at each context.")


# --- several GPUs -----------------------------------------------------------------------------

def select_parallel(rows: list[dict]) -> list[dict]:
    """bench_parallel.py rows on GPUs: the newest of each (attention, model, GPUs, TP, context);
    steps that a time limit cut are kept, with the passes they finished."""
    rows = [r for r in rows if shipped(r, PARALLEL_IMPLS.__contains__)]
    return sorted(newest_each(rows, lambda r: (r["impl"], r["model"], r["layers"], r["world"], r["tp"], r["seq_len"])),
                  key=lambda r: (r["impl"] != "sparse", r["seq_len"], r["tp"], r["world"]))


def parallel_settings(r: dict) -> str:
    s = [f"chunk {r['chunk_size']}"]
    if r.get("group_pages"):
        s.append(f"{r['group_pages']} pages a call")
    s += [f"offload '{r['offload']}'", f"{r['kv_grad_dtype']} dK/dV"]
    if r.get("compile"):
        s.append("compiled")
    if r.get("keep_attention") not in (None, "no"):
        s.append(f"keep_attention={r['keep_attention']}")
    return ", ".join(s)


def parallel_table(rows: list[dict], cmds: Commands) -> str:
    """DP efficiency: tokens/s per GPU against the 1-GPU row of the same commit, attention and context."""
    single = {(commit(r), r["impl"], r["seq_len"]): r["tok_s_per_gpu"]
              for r in rows if r["world"] == 1 and r.get("ok")}
    out = []
    for r in rows:
        base = single.get((commit(r), r["impl"], r["seq_len"]))
        if r.get("ok"):
            timing = [f"{r['step_s']:.2f}", num(r["tok_s"]), num(r["tok_s_per_gpu"]),
                      f"{r['tok_s_per_gpu'] / base:.1%}" if base and r["tp"] == 1 and r["world"] > 1 else "",
                      num(r.get("peak_gib"), ".1f")]
        else:
            timing = [f"not finished: {r.get('passes_done')} of {r.get('passes')} chunk passes in "
                      f"{r.get('elapsed_s')} s", "—", "—", "", "—"]
        out.append(["top-k" if r["impl"] == "sparse" else "dense", r["world"], f"{r['tp']} x {r['dp']}",
                    tokens(r["seq_len"]), parallel_settings(r), *timing, commit(r), day(r),
                    cmds.ref(parallel_command(r))])
    return table(["attention", "GPUs", "TP x DP", "context", "settings", "s / step", "tok/s", "tok/s per GPU",
                  "DP efficiency", "peak GiB per GPU", "commit", "date", "command"], out)


def parallel_section(rows: list[dict]) -> str:
    picked = select_parallel(rows)
    cmds = Commands()
    return section("multi-GPU", picked, cmds,
        "Qwen2.5-7B shape, full-parameter gradients, under `torchrun` on one host (H200s linked by NVLink): "
        "tensor-parallel ranks (TP) share each sequence, each holding its share of the heads; data-parallel "
        "ranks (DP) take a sequence each and all-reduce the gradients after the step (in the time). Peak memory "
        "is the largest over the ranks.",
        parallel_table(picked, cmds),
        "Rows: the newest row of each attention, GPU count, TP size and context. DP efficiency is tokens/s per "
        "GPU against the 1-GPU row of the same commit. A step cut by its command's time limit shows the chunk "
        "passes it finished (of n - 1 in stage 1 and n in stage 2).")


# --- long runs and sanitizers ------------------------------------------------------------------

SOAK_SERIES = [("gpu_alloc_gib", "GPU allocated"), ("gpu_reserved_gib", "GPU reserved"), ("host_rss_gib", "host RSS"),
               ("pinned_gib", "pinned")]


def on_gpu(rows: list[dict]) -> list[dict]:
    """Rows measured on a GPU from a commit of the main line."""
    return [r for r in rows if r.get("gpu", "cpu") != "cpu" and r.get("merged", True)]


def select_soak(rows: list[dict]) -> list[dict]:
    """soak.py rows on GPUs with a verdict (a run stopped after its baseline step has none): the
    newest of each model, context and mode."""
    key = lambda r: (r["model"], r["seq_len"], r["mode"])  # noqa: E731
    return sorted(newest_each([r for r in on_gpu(rows) if r.get("flat") is not None], key), key=key)


def select_sanitize(rows: list[dict]) -> list[dict]:
    """sanitize.py rows on GPUs: the newest of each kernel and tool."""
    key = lambda r: (r["kernel"], r["tool"])  # noqa: E731
    return sorted(newest_each(on_gpu(rows), key), key=key)


def without_results(cmd: str) -> str:
    """A bench command as it reproduces the row (its --results path was the run's own)."""
    return re.sub(r" --results \S+", "", cmd)


def growth(g: dict) -> str:
    pct = f" ({g['growth_pct']:+.2f} %)" if g.get("growth_pct") is not None else ""
    return f"{g['baseline_gib']:.2f}, {g['growth_gib']:+.3f}{pct}"


def reliability_section(soak: list[dict], sanitize: list[dict]) -> str:
    cmds, out = Commands(), []
    for r in select_soak(soak):
        median = sorted(r["step_s"])[len(r["step_s"]) // 2]
        out.append([r["model"], tokens(r["seq_len"]), r["mode"], f"{r['steps']}", f"{median:.1f}",
                    *(growth(r["growth"][k]) for k, _ in SOAK_SERIES), "flat" if r["flat"] else "**grows**",
                    commit(r), day(r), cmds.ref(without_results(r["command"]))])
    checks = []
    for r in select_sanitize(sanitize):
        found = r.get("hazards", r.get("errors", 0)) if r["tool"] == "racecheck" else r.get("errors", 0)
        checks.append([r["kernel"], r["tool"], r["status"], f"{found}", r.get("summary", ""), commit(r), day(r),
                       cmds.ref(f"python bench/sanitize.py --kernels {r['kernel']} --tools {r['tool']}")])
    return section("soak or sanitizer", out + checks, cmds,
        "Soak (`bench/soak.py`): `oomb train` for many steps, with the GPU's allocated and reserved memory and "
        "the process's resident and pinned host memory recorded after every step. Each series' baseline is "
        "its value after step 2; growth is the largest later value less the baseline (GiB, and % of the "
        "baseline); flat is growth <= max(1 %, 0.01 GiB) in every series.",
        table(["model", "context", "attention, offload", "steps", "median s / step",
               *(f"{name} GiB (baseline, growth)" for _, name in SOAK_SERIES), "verdict", "commit", "date",
               "command"], out) if out else "_No soak rows._",
        "Sanitizers (`bench/sanitize.py`): compute-sanitizer's memcheck, racecheck and synccheck on each kernel "
        "alone, at small shapes. The ws-control kernels are controls: Triton's warp specialisation with no data "
        "of their own (-bar adds the default partition's barrier, -mbarrier mbarriers, -capture a captured "
        "value, -all the three). racecheck flags hopper-backward on the bytes of Triton's warp-specialisation "
        "state only, and flags ws-control-bar, which has nothing else, on the same state: the hazards are the "
        "tool's reading of Triton's hand-off, not of the kernel's buffers ([experiments](experiments.md), "
        "\"Racecheck on the Gluon backward\").",
        table(["kernel", "tool", "status", "errors / hazards", "summary", "commit", "date", "command"], checks)
        if checks else "_No sanitizer rows._",
        "Rows: the newest soak row of each model, context and mode; the newest sanitizer row of each kernel and "
        "tool.")


# --- before and after a change ----------------------------------------------------------------

def select_before_after(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(before, after) row pairs of bench/before_after.py runs on GPUs that measured both trees:
    the newest pair of each before commit, context and settings."""
    rows = [r for r in on_gpu(rows) if r.get("ok")]
    pairs = {}
    for after in (r for r in rows if r["tree"] == "after"):
        before = [r for r in rows if r["tree"] == "before" and r["seq_len"] == after["seq_len"]
                  and r["date"] <= after["date"] and settings_of(r) == settings_of(after)]
        if before:
            b = newest(before)
            pairs[(b["commit"], after["seq_len"], json.dumps(settings_of(after), sort_keys=True))] = (b, after)
    return sorted(pairs.values(), key=lambda p: (p[1]["seq_len"], p[1]["date"]))


def settings_of(r: dict) -> dict:
    keys = ("model", "lora_rank", "chunk_size", "page_size", "backend", "offload", "sparse_budget", "kv_grad_dtype",
            "checkpoint_layers", "compile", "keep_attention", "param_grad_dtype", "repeats")
    return {k: r.get(k) for k in keys}


def before_after_command(r: dict) -> str:
    flags = [f"--lengths {tokens(r['seq_len'])}", f"--chunk-size {r['chunk_size']}"]
    flags += [f"--{k.replace('_', '-')} {r[k]}" for k, default in (
        ("model", "qwen2.5-7b"), ("lora_rank", 0), ("offload", "none"), ("sparse_budget", 0),
        ("kv_grad_dtype", "fp32"), ("param_grad_dtype", "param"), ("repeats", 1)) if r.get(k, default) != default]
    flags += [f"--{k.replace('_', '-')}" for k in ("checkpoint_layers", "compile", "keep_attention") if r.get(k)]
    return f"python bench/before_after.py --before DIR --before-commit {commit(r)} " + " ".join(flags)


def before_after_section(rows: list[dict]) -> str:
    cmds, out = Commands(), []
    for before, after in select_before_after(rows):
        out.append([tokens(after["seq_len"]), commit(before), commit(after), f"{before['median_s']:.2f}",
                    f"{after['median_s']:.2f}", f"{after['time_vs_before']:.3f}",
                    "yes" if after["grads_equal_before"] else "**no**", day(after),
                    cmds.ref(before_after_command(before))])
    if not out:
        return ("_No rows yet: `python bench/before_after.py --before DIR --lengths 64K --chunk-size 8192 --compile "
                "--keep-attention` (DIR: `git archive <commit> src | tar -x -C DIR`) measures them._")
    return section("before/after pair", out, cmds,
        "The same step (model, tokens, settings) run by an earlier commit's tree and this one's, each in its own "
        "process in the same command (`bench/before_after.py`): the median step time of each, their ratio, and "
        "whether every parameter's gradient is bitwise the same.",
        table(["context", "before", "after", "before s", "after s", "after ÷ before", "gradients bitwise equal",
               "date", "command"], out),
        "Rows: the newest pair of each earlier commit, context and settings.")


# --- the page ---------------------------------------------------------------------------------

REPRODUCE = """On a GPU machine, from the repository root (`PYTHONPATH=src`, or after `scripts/install.sh`). Each
script appends one JSON row per measurement to `bench/results/` (GPU, versions, commit, date and the
settings); on a machine without `.git`, set `OOMB_COMMIT` to the commit under test.

```bash
python bench/bench_attention.py --keys 16384,65536,262144,1048576        # kernels vs SDPA (cuDNN, flash)
python bench/bench_attention.py --keys 262144,1048576 --sparse 64 --kernels --no-sdpa   # top-k kernels, per kernel
python bench/bench_step.py --impls oomb,liger --oomb-compile --keep-attention yes --chunk-size 16384 --lengths 64K
python bench/bench_step.py --impls oomb-sparse-auto --kv-grad-dtype bf16 --oomb-compile --lengths 1M \\
  --keep-attention fit --kept-host-gib 172                                 # 1M top-k, outputs kept on the host
# the least GPU memory: top-k, offload 'all', each layer recomputed in the backward
python bench/bench_step.py --impls oomb-sparse-all --kv-grad-dtype bf16 --checkpoint-layers --lengths 1M
python bench/bench_step.py --model gpt-oss-20b --lora-rank 16 --impls oomb-sparse-auto --kv-grad-dtype bf16 --lengths 1M
python bench/bench_offload.py --modes none,all --lengths 128K             # offload modes: time, memory, equal gradients
torchrun --nproc-per-node 4 bench/bench_parallel.py --tp 4 --lengths 1M --impls sparse --compile --kv-grad-dtype bf16
python bench/bench_step.py --impls oomb-sparse-all --lengths 64K --kv-grad-dtype bf16 --profile /tmp/prof \\
  && python bench/trace_gaps.py /tmp/prof                                # where a profiled step's GPU time goes
python bench/memory_trace.py --offload all --lengths 32K,64K --layers 28  # what a step's GPU memory holds at its peak
python bench/tune_attention.py --keys 65536                              # the kernels' tile settings
python bench/kernel_ir.py                                                # (no GPU) which kernel loops Triton pipelines
python bench/bench_copy.py                                               # host<->GPU page copies, GB/s
python bench/bench_pin.py --gib 16                                       # pinning host memory, torch vs oomb
python bench/soak.py --model byte-lm-30m --seq-len 256K --offload none --steps 20   # memory over 20 steps
python bench/sanitize.py                                                 # compute-sanitizer on each kernel
python bench/before_after.py --before DIR --lengths 64K --compile        # an earlier commit's step (DIR/src) beside this one's
python bench/report.py                                                   # this page and its plots
```

`oomb plan` gives the GPU and host memory a configuration should need (and the longest context that fits)
before a run; `python bench/bench_step.py --device cpu --model tiny` is the smoke run the tests do. Step rows
also carry the GPU's mean SM clock, power and the share of the step spent at its power cap (`sm_mhz`,
`power_w`, `power_capped`): a long step on an H200 runs at the 700 W cap, near 1,700 MHz, where the short
kernel benchmarks run at 1,980 MHz, so a kernel's gain shrinks in the step. What was tried and did not
help is in `docs/experiments.md`."""


def intro(used: list[dict]) -> str:
    def versions(key):
        return ", ".join(sorted({str(r.get(key)) for r in used if r.get(key)})) or "—"
    most_host = max((r.get("host_peak_gib") or 0 for r in used), default=0)
    return "\n\n".join([
        "# Benchmarks",
        "Measurements of oomb on NVIDIA H200 GPUs (139.8 GiB each) in machines with 16 host cores and 128 GiB "
        "of host memory per GPU (a two-GPU machine: 32 cores, 256 GiB), one section per question. A process may "
        f"use more of the host's memory than its GPU's share: host GiB in the tables, up to {most_host:.0f} GiB "
        "in a row shown here. Every table and plot is generated by `python bench/report.py` "
        "from the rows in `bench/results/*.jsonl`, and every row names the commit and date it measured and the "
        "command that reproduces it (rebuilt from the settings the row records; a setting a row does not record "
        "was its commit's default). Models have the preset's shape with random bf16 weights (speed and memory do "
        "not depend on the values): Qwen2.5-7B unless a row says otherwise.",
        f"Software of the rows shown: torch {versions('torch')}; triton {versions('triton')}; "
        f"transformers {versions('transformers')}.",
        "Each table shows the current answer from the rows that measured the main line's code (not A/B arms, "
        "reverted variants, unmerged branches, profiled or disturbed runs), picked by the rule under the table, "
        "usually the newest run of each configuration; a row's commit and date say how recent its figure is. "
        "Earlier rows stay in the results files.",
    ])


def build(results: str, out_dir: str) -> str:
    """Writes benchmarks.md and the plots into out_dir; returns the page."""
    import matplotlib

    matplotlib.use("Agg")
    steps, attention, parallel, soak, sanitize, before_after = (load(results, n) for n in (
        "step.jsonl", "attention.jsonl", "parallel.jsonl", "soak.jsonl", "sanitize.jsonl", "before_after.jsonl"))
    os.makedirs(out_dir, exist_ok=True)
    modes = select_memory(steps)
    plot_modes(modes, "peak_gib", "peak GPU memory (GiB)", "GPU memory of one training step",
               os.path.join(out_dir, "memory_vs_context.png"), capacity=True)
    plot_modes(modes, "tok_s", "tokens / s (one step, forward + backward)", "Training speed",
               os.path.join(out_dir, "tokens_per_s_vs_context.png"))
    plot_1m_breakdown(select_topk(steps), os.path.join(out_dir, "step_1m_breakdown.png"))
    used = ([r for e in select_kernels(attention) for k, r in e.items() if isinstance(r, dict)]
            + [r for pair in select_dense_steps(steps) for r in pair if r]
            + [r for pair in select_trainer(steps) for r in pair if r] + [r for _, m in modes for r in m]
            + select_topk(steps) + select_longest(steps) + select_gpu_sizes(steps)
            + [r for trio in select_packed(steps) for r in trio if r] + select_gpt_oss(steps)
            + select_parallel(parallel)
            + select_soak(soak) + select_sanitize(sanitize) + [r for pair in select_before_after(before_after)
                                                                 for r in pair])
    bodies = [kernels_section(attention), dense_step_section(steps), trainer_section(steps), memory_section(steps),
              topk_section(steps),
              offload_section(steps), longest_section(steps), gpu_sizes_section(steps, out_dir), packed_section(steps),
              gpt_oss_section(steps),
              parallel_section(parallel),
              reliability_section(soak, sanitize), before_after_section(before_after), REPRODUCE]
    page = intro(used) + "\n\n" + "\n\n".join(f"## {title}\n\n{body}" for title, body in zip(SECTIONS, bodies)) + "\n"
    with open(os.path.join(out_dir, "benchmarks.md"), "w") as f:
        f.write(page)
    return page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="directory of *.jsonl result rows")
    ap.add_argument("--out-dir", default=os.path.normpath(os.path.join(HERE, "..", "docs")),
                    help="where benchmarks.md and the plots go")
    args = ap.parse_args()
    page = build(args.results, args.out_dir)
    print(f"{os.path.join(args.out_dir, 'benchmarks.md')}: {page.count(chr(10))} lines")


if __name__ == "__main__":
    main()
