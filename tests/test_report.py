"""bench/report.py (the page) and bench/report_*.py (its sections): the benchmarks page and its plots,
generated from result rows (here a few sample rows in a temporary directory), and the rules that pick
each table's rows."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402
import report_before_after  # noqa: E402
import report_common  # noqa: E402
import report_dense  # noqa: E402
import report_gpu_sizes  # noqa: E402
import report_memory  # noqa: E402
import report_offload  # noqa: E402
import report_packed  # noqa: E402
import report_plan  # noqa: E402
import report_reliability  # noqa: E402
import report_trainer  # noqa: E402

HEADINGS = ["Kernels vs cuDNN", "Dense step vs transformers and Liger", "The trainer end to end", "GPU memory vs context",
            "Top-k sparse steps",
            "Offload overhead", "Longest context", "Smaller GPUs", "Packed documents", "GPT-OSS", "Several GPUs",
            "Long runs and sanitizers", "Before and after a change", "How to reproduce"]
PLOTS = ["memory_vs_context.png", "tokens_per_s_vs_context.png", "step_1m_breakdown.png", "longest_context_vs_gpu.png"]
MACHINE = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0"}
K, M = 1024, 2**20


def step(impl, n, step_s, peak, commit="a1b2c3d", date="2026-12-01T01:00:00+00:00", **settings):
    oomb = impl.startswith("oomb")
    row = {"bench": "step", "impl": impl, "model": "qwen2.5-7b", "lora_rank": 0, "seq_len": n, "layers": 28,
           "chunk_size": 4096 if oomb else None, "kv_grad_dtype": "fp32" if oomb else None,
           "checkpoint_layers": False if oomb else None, "liger": impl == "liger", "compile": oomb, "float8": "none",
           "param_grad_dtype": "param" if oomb else None, "keep_attention": "no" if oomb else None,
           "page_budget_gib": None, "reserve_s": 1.0 if oomb else None, "ok": True, "step_s": step_s,
           "tok_s": round(n / step_s, 1), "peak_gib": peak, "host_peak_gib": 2.0, "commit": commit, "date": date,
           **MACHINE}
    if "sparse" in impl:
        row["kv_grad_dtype"] = "bf16"
    row.update(settings)
    return row


KEPT = {"keep_attention": "yes", "kept_layers": 27, "kept_where": "gpu", "kept_host_layers": 0}
STAGES = {"stage1_s": 33.3, "stage2_s": 111.7, "stage1_chunk_ms": [129.5, 129.0, 129.9, 134.3],
          "stage2_chunk_ms": [434.8, 436.5, 435.8, 437.7]}


def sample_steps():
    return [
        step("oomb", 32 * K, 4.26, 111.1, chunk_size=16384, **KEPT),
        step("liger", 32 * K, 4.48, 40.8, date="2026-12-01T01:01:00+00:00"),
        step("oomb", 64 * K, 11.97, 122.3, chunk_size=16384, date="2026-12-01T01:02:00+00:00", **KEPT),
        step("liger", 64 * K, 12.41, 52.9, date="2026-12-01T01:03:00+00:00"),
        step("oomb-all", 64 * K, 12.73, 79.8, chunk_size=8192, host_layers=28, date="2026-12-01T01:04:00+00:00", **KEPT),
        step("oomb", 64 * K, 12.76, 87.4, chunk_size=8192, date="2026-12-01T01:05:00+00:00", **KEPT),
        step("oomb-sparse-auto", M, 144.99, 128.96, host_layers=8, **STAGES),
        step("oomb-sparse-all", M, 143.72, 126.95, host_layers=28, date="2026-12-01T01:10:00+00:00",
             **{**STAGES, "stage1_s": 34.2, "stage2_s": 109.5}),
        step("oomb-sparse-auto", 2 * M, 473.2, 137.05, commit="0f1e2d3", date="2026-11-29T13:05:00+00:00",
             lora_rank=16, checkpoint_layers=True, host_peak_gib=105.7),
        step("oomb-sparse-auto", 128 * K, 19.26, 69.41, commit="0f1e2d3", date="2026-11-29T13:14:00+00:00",
             model="gpt-oss-20b", layers=24, lora_rank=16),
        # a 24 GiB GPU's memory (the process capped): LoRA steps until the first that does not fit
        step("oomb-default", 256 * K, 60.0, 21.5, lora_rank=16, gpu_cap_gib=24, checkpoint_layers=True,
             kv_grad_dtype="bf16", date="2026-12-01T02:00:00+00:00"),
        step("oomb-default", 128 * K, 25.0, 20.9, lora_rank=16, gpu_cap_gib=24, checkpoint_layers=True,
             date="2026-12-01T01:59:00+00:00"),
        step("liger", 64 * K, 14.0, 21.0, lora_rank=16, gpu_cap_gib=24, date="2026-12-01T02:01:00+00:00"),
        # 128K packed from 8K documents: oomb masked to each document, Liger a batch of 16 sequences;
        # the dense oomb-default step beside them, and an older packed row that is not picked
        step("oomb-default", 128 * K, 9.0, 100.0, packed_docs=8 * K, date="2026-12-01T03:00:00+00:00"),
        step("liger", 128 * K, 12.0, 60.0, packed_docs=8 * K, date="2026-12-01T03:01:00+00:00"),
        step("oomb-default", 128 * K, 36.0, 120.0, date="2026-12-01T03:02:00+00:00"),
        step("liger", 128 * K, 39.0, 80.0, date="2026-12-01T03:03:00+00:00"),
        step("oomb-default", 128 * K, 99.0, 100.0, packed_docs=8 * K, date="2026-11-30T03:00:00+00:00"),
        # oomb train itself at 128K, beside the oomb-default step above
        step("oomb-train", 128 * K, 36.5, 120.5, date="2026-12-01T03:10:00+00:00", sparse_budget=0, train_steps=3,
             trainer_step_s=[70.0, 36.4, 36.6]),
        # newer, and none of them measured the code as shipped: never picked
        step("oomb two-state-fwd(reverted)", 64 * K, 1.0, 1.0, date="2026-12-02T00:00:00+00:00"),
        step("oomb", 64 * K, 1.0, 1.0, chunk_size=16384, merged=False, date="2026-12-02T00:01:00+00:00", **KEPT),
        step("oomb", 64 * K, 1.0, 1.0, chunk_size=16384, profiled=True, date="2026-12-02T00:02:00+00:00", **KEPT),
        step("oomb", 64 * K, 1.0, 1.0, chunk_size=16384, switches={"OOMB_GLUON": "0"},
             date="2026-12-02T00:03:00+00:00", **KEPT),
    ]


def sample_attention():
    run = {"C": 4096, "H": 28, "Hkv": 4, "D": 128, "page_size": 128, "dtype": "bf16", "commit": "a1b2c3d",
           "date": "2026-12-01T03:33:00+00:00", **MACHINE}
    return [{**run, "N": 64 * K, "impl": "paged", "fwd_ms": 7.02, "bwd_ms": 20.69, "fwd_tflops": 565.5, "bwd_tflops": 479.6},
            {**run, "N": 64 * K, "impl": "sdpa_cudnn", "fwd_ms": 6.07, "bwd_ms": 17.57, "fwd_tflops": 634.0,
             "bwd_tflops": 547.7},
            {**run, "N": 64 * K, "impl": "sdpa_flash", "fwd_ms": 10.9, "bwd_ms": 30.4, "fwd_tflops": 352.8,
             "bwd_tflops": 316.0},
            {**run, "N": M, "impl": "paged-sparse64", "sparse_budget": 64, "chunk_budget": 256, "fwd_ms": 1.2,
             "bwd_ms": 4.0, "fwd_tflops": 502.6, "bwd_tflops": 374.8}]


def sample_parallel():
    run = {"bench": "parallel", "impl": "sparse", "model": "qwen2.5-7b", "seq_len": 256 * K, "layers": 28,
           "chunk_size": 4096, "group_pages": 128, "offload": "auto", "kv_grad_dtype": "bf16", "compile": True,
           "ok": True, "commit": "a1b2c3d", "date": "2026-11-30T22:17:30+00:00", **MACHINE}
    return [{**run, "world": 1, "tp": 1, "dp": 1, "step_s": 36.71, "tok_s": 7140.0, "tok_s_per_gpu": 7140.0,
             "peak_gib": 76.35},
            {**run, "world": 2, "tp": 1, "dp": 2, "step_s": 36.83, "tok_s": 14234.2, "tok_s_per_gpu": 7117.1,
             "peak_gib": 76.35}]


def sample_soak():
    flat = {"baseline_gib": 7.6, "max_gib": 7.6, "growth_gib": 0.0, "growth_pct": 0.0, "slope_gib_per_step": 0.0,
            "ok": True}
    return [{"bench": "soak", "model": "byte-lm-30m", "seq_len": 256 * K, "mode": "dense, offload none", "steps": 20,
             "step_s": [21.3, 23.6, 22.6], "growth": {k: flat for k, _ in report_reliability.SOAK_SERIES},
             "flat": True,
             "command": "python bench/soak.py --model byte-lm-30m --seq-len 256K --steps 20 --results /x/soak.jsonl",
             "commit": "a1b2c3d", "date": "2026-12-02T07:11:27+00:00", **MACHINE}]


def sample_sanitize():
    return [{"bench": "sanitize", "kernel": k, "tool": t, "status": "clean", "errors": 0, "hazards": 0,
             "summary": "ERROR SUMMARY: 0 errors", "commit": "a1b2c3d", "date": "2026-12-02T07:04:54+00:00",
             "command": f"compute-sanitizer --tool {t} python bench/sanitize.py --kernel {k}", **MACHINE}
            for k in ("forward", "backward") for t in ("memcheck", "racecheck")]


def sample_before_after():
    common = dict(bench="before_after", ok=True, seq_len=64 * K, model="qwen2.5-7b", lora_rank=0, chunk_size=8192,
                  page_size=128, backend="auto", offload="none", sparse_budget=0, kv_grad_dtype="fp32",
                  checkpoint_layers=False, compile=True, keep_attention=True, param_grad_dtype="param", repeats=3,
                  **MACHINE)
    return [dict(common, tree="before", commit="991b9bd", median_s=12.0, date="2026-12-04T01:00:00+00:00"),
            dict(common, tree="after", commit="abc1234", median_s=12.12, time_vs_before=1.01,
                 grads_equal_before=True, date="2026-12-04T01:01:00+00:00")]


def write_results(path):
    path.mkdir()
    for name, rows in (("step", sample_steps()), ("attention", sample_attention()), ("parallel", sample_parallel()),
                       ("soak", sample_soak()), ("sanitize", sample_sanitize()), ("before_after", sample_before_after())):
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def sections(page: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def table_rows(body: str) -> list[str]:
    """Every table's data rows (not its header, the line before a |--- rule, nor the rule)."""
    lines = [line for line in body.splitlines() if line.startswith("|")]
    return [line for line, after in zip(lines, lines[1:] + [""])
            if not line.startswith("|---") and not after.startswith("|---")]


def test_report_writes_the_page_and_its_plots(tmp_path):
    write_results(tmp_path / "results")
    out = tmp_path / "docs"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), "--results", str(tmp_path / "results"),
                    "--out-dir", str(out)], check=True, capture_output=True, timeout=300)
    page = (out / "benchmarks.md").read_text()
    assert page.count("\n") <= 400
    assert re.findall(r"^## (.+)$", page, flags=re.M) == HEADINGS
    for title, body in sections(page).items():
        if title == "How to reproduce":
            continue
        rows = table_rows(body)
        assert rows, f"{title}: no table rows"
        for row in rows:
            assert re.search(r"\b[0-9a-f]{7}\b", row) and re.search(r"\b\d{4}-\d{2}-\d{2}\b", row), (title, row)
            assert re.search(r"\[\d+\]", row), (title, row)  # the command it came from, listed under the table
        assert "`python bench/" in body or "`torchrun " in body, title
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in page, name


def test_rows_of_unshipped_code_are_left_out():
    """A hand-labelled A/B arm, a row of a never-merged commit, a profiled row and one run under an
    environment switch are all newer than the shipped rows; none of them is picked."""
    steps = sample_steps()
    picked = [r for pair in report_dense.select_dense_steps(steps) for r in pair if r]
    picked += [r for _, rows in report_memory.select_memory(steps) for r in rows]
    assert picked and all(r["step_s"] != 1.0 for r in picked)
    assert {(r["seq_len"], r["step_s"]) for r, _ in report_dense.select_dense_steps(steps)} == {
        (32 * K, 4.26), (64 * K, 11.97), (64 * K, 12.76), (128 * K, 36.0)}


def test_dense_steps_pair_with_the_liger_step_of_their_run():
    older = step("liger", 64 * K, 12.0, 50.0, commit="0f1e2d3", date="2026-11-30T01:00:00+00:00")
    pairs = report_dense.select_dense_steps(sample_steps() + [older])
    assert all(liger is not None and liger["commit"] == r["commit"] for r, liger in pairs)
    assert [liger["step_s"] for r, liger in pairs if r["seq_len"] == 64 * K] == [12.41, 12.41]
    # what oomb train chooses (no tuning flags), beside the Liger step of its run
    default = step("oomb-default", 64 * K, 11.5, 120.0, chunk_size=8192, commit="9a8b7c6",
                   date="2026-12-03T01:00:00+00:00")
    liger = step("liger", 64 * K, 12.3, 52.9, commit="9a8b7c6", date="2026-12-03T01:02:00+00:00")
    pairs = report_dense.select_dense_steps(sample_steps() + [default, liger])
    # each kind's newest run: the tuned steps of one run, oomb train's choice of another
    assert [(r["impl"], r["commit"], b["step_s"]) for r, b in pairs if r["seq_len"] == 64 * K] == [
        ("oomb", "a1b2c3d", 12.41), ("oomb", "a1b2c3d", 12.41), ("oomb-default", "9a8b7c6", 12.3)]


def test_a_peak_counts_only_at_the_longest_length_of_its_process():
    """bench_step.py reserves pages for the longest length first: the 64K row of a 64K + 256K
    process shows the 256K pages; the memory table takes the 64K peak of another process."""
    same_process = dict(commit="a1b2c3d", date="2026-12-01T05:00:00+00:00")
    rows = [step("oomb", 64 * K, 16.2, 90.1, **same_process), step("oomb", 256 * K, 176.4, 90.1, **same_process),
            step("oomb", 64 * K, 16.4, 58.6, date="2026-11-30T05:00:00+00:00")]
    (label, picked), = report_memory.select_memory(rows)
    assert label.startswith("oomb dense, offload none")
    assert [(r["seq_len"], r["peak_gib"]) for r in picked] == [(64 * K, 58.6), (256 * K, 90.1)]


def test_offload_compares_all_with_the_same_settings_on_the_gpu():
    (a, b), = [pair for pair in report_offload.select_offload(sample_steps()) if pair[0]["seq_len"] == 64 * K]
    assert (a["impl"], a["step_s"], b["impl"], b["step_s"]) == ("oomb-all", 12.73, "oomb", 12.76)
    (a, b), = [pair for pair in report_offload.select_offload(sample_steps()) if pair[0]["seq_len"] == M]
    assert (b["impl"], b["host_layers"]) == ("oomb-sparse-auto", 8)  # 1M fits nowhere without offload


def test_commands_are_rebuilt_from_the_settings_a_row_records():
    row = step("oomb-sparse-auto", M, 145.0, 129.0, keep_attention="fit", kept_layers=24, kept_where="host",
               kept_host_layers=24, kept_host_gib=169.96, group_pages=128)
    assert report_common.step_command(row) == (
        "python bench/bench_step.py --impls oomb-sparse-auto --lengths 1M --kv-grad-dtype bf16 --oomb-compile "
        "--keep-attention fit --kept-host-gib 170 --group-pages 128")
    assert report_common.step_command(step("liger", 32 * K, 4.5, 40.8)) == (
        "python bench/bench_step.py --impls liger --lengths 32K")
    assert report_common.step_command(step("liger", 32 * K, 4.5, 40.8, step_times=[4.6, 4.5, 4.4])) == (
        "python bench/bench_step.py --impls liger --lengths 32K --repeats 3")
    assert report_common.attention_command(sample_attention()[-1]) == (
        "python bench/bench_attention.py --keys 1048576 --sparse 64 --no-sdpa")


def test_the_repository_page_is_the_generated_one(tmp_path):
    """docs/benchmarks.md is what report.py makes of bench/results: rerun it after adding rows."""
    report.build(os.path.join(ROOT, "bench", "results"), str(tmp_path))
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        assert (tmp_path / "benchmarks.md").read_text() == f.read()


def test_capped_steps_give_the_longest_context_per_gpu_size(tmp_path):
    """Rows of a capped process (a smaller GPU's memory) stay out of the whole-GPU tables; the
    'Smaller GPUs' table takes the longest context each implementation finished at each cap, and
    rebuilds its command without engine flags for what oomb train chose."""
    rows = sample_steps()
    picked = report_gpu_sizes.select_gpu_sizes(rows)
    assert [(r["impl"], r["seq_len"]) for r in picked] == [("liger", 64 * K), ("oomb-default", 256 * K)]
    assert all(not r.get("gpu_cap_gib") for r in report_common.step_rows(rows))
    assert report_common.step_command(picked[1]) == ("python bench/bench_step.py --impls oomb-default --lengths 256K "
                                                    "--lora-rank 16 --gpu-cap-gib 24")
    # the plan's longest context at that cap: oomb train chooses settings for it, not for 8 chunks more
    from oomb.auto import Machine, NothingFits, choose
    from oomb.config import EngineConfig
    from oomb.presets import preset_config

    longest = report_plan.auto_longest(picked[1])
    config, machine = preset_config("qwen2.5-7b"), Machine(24 * 2**30, report_plan.PLAN_HOST_GIB * 2**30)
    base, lora = EngineConfig(offload="auto", keep_attention=None), {"trainable_params": 20_185_088}
    assert longest >= picked[1]["seq_len"] and choose(config, longest, machine, base, **lora).fit.fits
    with pytest.raises(NothingFits):
        choose(config, longest + 8 * 1024, machine, base, **lora)


def test_packed_steps_pair_with_liger_batches_and_the_dense_step():
    """A packed oomb step sits beside its run's Liger step over the same documents as a batch and
    the newest dense step of the same implementation at that context; packed rows stay out of
    the whole-GPU tables."""
    rows = sample_steps()
    [(mine, liger, dense)] = report_packed.select_packed(rows)
    assert (mine["step_s"], liger["step_s"], dense["step_s"]) == (9.0, 12.0, 36.0)
    assert all(not r.get("packed_docs") for r in report_common.step_rows(rows))
    body = report_packed.packed_section(rows)
    [line] = table_rows(body)
    assert "| 128K | 8K | 16 |" in line and "| 1.33 |" in line and "| 4.00 |" in line
    assert "--packed-docs 8K" in body


def test_the_plan_is_within_ten_percent_of_every_measured_step():
    """Every oomb step in bench/results that records where its engine placed pages and kept
    outputs peaked within 10 % of what oomb.plan gives that step today (and the failing 24 GiB
    LoRA step, chunk 8192 with its layers recomputed, which ran out with 23.35 GiB allocated, is
    no longer planned below what it took by more than that)."""
    checked = report_plan.plan_checked(report_common.load(os.path.join(ROOT, "bench", "results"), "step.jsonl"))
    assert len(checked) >= 10
    off = [(r["impl"], r["seq_len"], r["commit"], round(x, 3)) for r, x in checked if not 0.9 <= x <= 1.1]
    assert not off
    ran_out = dict(impl="oomb-default", seq_len=256 * K, lora_rank=16, chunk_size=8192, kv_grad_dtype="fp32",
                   checkpoint_layers=True, compile=False, param_grad_dtype="fp32", host_layers=27, kept_layers=27,
                   kept_host_layers=27)
    assert 23.35 * 2**30 / report_plan.planned_peak(ran_out) <= 1.1


def test_soak_rows_without_a_verdict_are_left_out():
    """A resumed soak run stopped after its baseline step has no verdict: the table keeps the
    newest run of that model, context and mode that has one."""
    base = dict(bench="soak", model="byte-lm-30m", seq_len=M, mode="top-k 64, offload auto", gpu="NVIDIA H200")
    judged = dict(base, date="2026-12-03T07:10:59+00:00", flat=True, steps=7)
    resumed = dict(base, date="2026-12-03T07:13:00+00:00", flat=None, steps=1, growth={})
    assert report_reliability.select_soak([judged, resumed]) == [judged]
    assert report_reliability.select_soak([resumed]) == []


def test_before_after_pairs_and_their_command():
    """A before/after run's two rows become one line: both medians, their ratio, whether the
    gradients were bitwise equal; the command is rebuilt from the settings the rows record."""
    before, after = sample_before_after()
    assert report_before_after.select_before_after([before, after, dict(after, seq_len=M)]) == [(before, after)]
    [line] = table_rows(report_before_after.before_after_section([before, after]))
    assert "| 64K | 991b9bd | abc1234 | 12.00 | 12.12 | 1.010 | yes |" in line
    assert report_before_after.before_after_command(before) == (
        "python bench/before_after.py --before DIR --before-commit 991b9bd --lengths 64K --chunk-size 8192 "
        "--repeats 3 --compile --keep-attention")


def test_trainer_rows_pair_with_the_engine_only_step_of_the_same_choice():
    """An `oomb train` row (median of the steps after the first) beside the newest whole-GPU
    oomb-default step of the same model and context; a capped or LoRA engine step is not its pair."""
    trainer = step("oomb-train", 64 * K, 12.6, 101.0, date="2026-12-04T02:00:00+00:00", sparse_budget=0,
                   train_steps=4, trainer_step_s=[40.1, 12.5, 12.6, 12.7])
    engine = step("oomb-default", 64 * K, 12.2, 100.0, date="2026-12-04T01:00:00+00:00")
    others = [step("oomb-default", 64 * K, 9.0, 20.0, gpu_cap_gib=24, date="2026-12-04T01:30:00+00:00"),
              step("oomb-default", 64 * K, 9.0, 20.0, lora_rank=16, date="2026-12-04T01:40:00+00:00"),
              step("oomb-default", 64 * K, 12.0, 100.0, date="2026-12-03T01:00:00+00:00")]
    [(picked, beside)] = report_trainer.select_trainer([trainer, engine, *others])
    assert picked == trainer and beside["date"] == engine["date"] and beside["step_s"] == 12.2
    [line] = table_rows(report_trainer.trainer_section([trainer, engine, *others]))
    assert "| 64K | qwen2.5-7b, full | dense | 4 | 40.10 | 12.60 | 5,201 | 101.0 | 12.20 | a1b2c3d | 0.968 |" in line
    assert "python bench/bench_step.py --impls oomb-train --lengths 64K --train-steps 4" in (
        report_trainer.trainer_section([trainer, engine]))
    assert report_trainer.trainer_section([engine]).startswith("_No rows yet")
    # a newer engine-only step of another commit: the trainer's own commit's stays its pair
    later = step("oomb-default", 64 * K, 11.9, 100.0, commit="e5f6a7b", date="2026-12-05T01:00:00+00:00")
    [(_, beside)] = report_trainer.select_trainer([trainer, engine, later])
    assert beside["step_s"] == 12.2
    [(_, beside)] = report_trainer.select_trainer([trainer, later])
    assert beside["step_s"] == 11.9
