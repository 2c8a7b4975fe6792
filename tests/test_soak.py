"""bench/soak.py: the flatness verdict on made-up metrics, and the CPU smoke run end to end."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402
import soak  # noqa: E402


def rows(**series):
    """metrics.jsonl step rows with the given per-step values of each series."""
    n = len(next(iter(series.values())))
    return [{"step": i + 1, "step_s": 1.0, **{k: v[i] for k, v in series.items()}} for i in range(n)]


def test_flat_series_pass_and_a_growing_one_fails():
    # step 1 is warm-up (kernels, optimizer state, the caching allocator): its jump is not growth
    flat = rows(gpu_alloc_gib=[10.0, 20.0, 20.0, 20.05, 19.9, 20.1], host_rss_gib=[3.0, 4.0, 4.02, 4.0, 4.01, 4.0])
    verdict = soak.analyse(flat)
    assert verdict["flat"] is True and set(verdict["checks"]) == {"gpu_alloc_gib", "host_rss_gib"}
    alloc = verdict["checks"]["gpu_alloc_gib"]
    assert alloc["baseline_gib"] == 20.0 and alloc["max_gib"] == 20.1 and alloc["growth_pct"] == 0.5

    # 0.3 % a step: under 1 % by step 4, over it by step 6
    growing = rows(gpu_alloc_gib=[10.0, 20.0, 20.06, 20.12, 20.18, 20.24], host_rss_gib=[4.0] * 6)
    verdict = soak.analyse(growing)
    assert verdict["flat"] is False and not verdict["checks"]["gpu_alloc_gib"]["ok"]
    assert verdict["checks"]["host_rss_gib"]["ok"]
    assert abs(verdict["checks"]["gpu_alloc_gib"]["slope_gib_per_step"] - 0.06) < 1e-9
    assert soak.analyse(growing[:4])["flat"] is True


def test_small_series_floor_skipped_steps_and_too_few_steps():
    # 5 MiB on a 0.1 GiB series is 5 %, but under the 0.01 GiB floor; an empty series stays flat
    verdict = soak.analyse(rows(pinned_gib=[0.1, 0.1, 0.105, 0.1], gpu_reserved_gib=[0.0] * 4))
    assert verdict["flat"] is True and verdict["checks"]["pinned_gib"]["growth_pct"] == 5.0
    assert soak.analyse(rows(pinned_gib=[0.1, 0.1, 0.115, 0.1]))["flat"] is False
    assert soak.analyse(rows(pinned_gib=[1.0, 1.0]))["flat"] is None  # nothing after the baseline
    lines = [json.dumps(r) for r in rows(pinned_gib=[1.0, 1.0, 1.0])]
    lines.insert(1, json.dumps({"step": 2, "skipped": True, "loss": "nan"}))
    lines.insert(2, json.dumps({"step": 2, "eval_loss": 3.0}))
    assert [r["step"] for r in common.logged_steps(lines + ['{"step": 4, "lo'])] == [1, 2, 3]  # the last: half written


def test_cpu_smoke_end_to_end(tmp_path):
    """The smoke run passes: memory flat over the steps after the baseline (3 of them, so a leak
    adds up), exit 0, PASS printed; a run that grows fails it."""
    results = tmp_path / "soak.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "soak.py"), "--smoke", "--steps", "5",
           "--out-dir", str(tmp_path / "run"), "--results", str(results)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    (row,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert out.returncode == 0 and row["flat"] is True, (row["growth"], out.stderr[-2000:])
    assert "soak: PASS" in out.stdout
    assert (row["model"], row["seq_len"], row["mode"], row["steps"], row["stopped"], row["floor_gib"]) == (
        "tiny", 1024, "top-k 2, offload all", 5, "done", 0.1)
    assert len(row["series"]["host_rss_gib"]) == 5 and row["host_layers"] == 2  # offload all: every layer (tiny: 2)
    assert set(row["growth"]) == {"host_rss_gib", "pinned_gib"} and all(c["ok"] for c in row["growth"].values())
    assert row["train_command"].startswith("oomb train --model tiny --seq-len 1024 --steps 5")
    assert row["commit"] and row["date"] and row["gpu"] == "cpu"
