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
import os
import sys

# Each section of the page is a module of its own (report_kernels.py ... report_before_after.py),
# on the rows, formatting and commands of report_common.py and the plan figures of report_plan.py;
# this file puts them together in the page's order.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # the section modules beside this file
from report_before_after import before_after_section, select_before_after  # noqa: E402
from report_common import load  # noqa: E402
from report_dense import dense_step_section, select_dense_steps  # noqa: E402
from report_gpt_oss import gpt_oss_section, select_gpt_oss  # noqa: E402
from report_gpu_sizes import gpu_sizes_section, select_gpu_sizes  # noqa: E402
from report_kernels import kernels_section, select_kernels  # noqa: E402
from report_longest import longest_section, select_longest  # noqa: E402
from report_memory import memory_section, plot_modes, select_memory  # noqa: E402
from report_offload import offload_section  # noqa: E402
from report_packed import packed_section, select_packed  # noqa: E402
from report_parallel import parallel_section, select_parallel  # noqa: E402
from report_reliability import reliability_section, select_sanitize, select_soak  # noqa: E402
from report_topk import plot_1m_breakdown, select_topk, topk_section  # noqa: E402
from report_trainer import select_trainer, trainer_section  # noqa: E402

SECTIONS = ["Kernels vs cuDNN", "Dense step vs transformers and Liger", "The trainer end to end", "GPU memory vs context",
            "Top-k sparse steps",
            "Offload overhead", "Longest context", "Smaller GPUs", "Packed documents", "GPT-OSS", "Several GPUs",
            "Long runs and sanitizers", "Before and after a change", "How to reproduce"]


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
