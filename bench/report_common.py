"""The rows, their formatting and the commands rebuilt from them, shared by the sections of
docs/benchmarks.md (bench/report.py assembles the page; report_*.py, one a section, pick and render
the rows).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict

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
BASELINES = {"liger": "transformers + Liger", "hf": "transformers"}


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


def on_gpu(rows: list[dict]) -> list[dict]:
    """Rows measured on a GPU from a commit of the main line."""
    return [r for r in rows if r.get("gpu", "cpu") != "cpu" and r.get("merged", True)]


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
