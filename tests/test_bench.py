"""The benchmark scripts run end to end (CPU, tiny preset), so a GPU call never finds them broken."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


HELP_ALL = """
import contextlib, os, runpy, sys, traceback
import torch, transformers  # once: each script's --help then runs in a fork of this process
failed = []
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        sys.argv = [path, "--help"]
        code = 2  # returned without printing its usage
        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = 0 if e.code in (0, None) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(f"{path}: exit status {status}")
print(*failed, sep=chr(10))
sys.exit(1 if failed else 0)
"""


def test_every_bench_script_imports_and_parses_its_arguments():
    """`--help` of each script (one process for all): its imports and argument defaults still
    match the package (a renamed module or a changed default fails here, not on the GPU machine)."""
    scripts = sorted(os.path.join(ROOT, "bench", f) for f in os.listdir(os.path.join(ROOT, "bench"))
                     if f.endswith(".py") and "__main__" in open(os.path.join(ROOT, "bench", f)).read())
    assert len(scripts) >= 10
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    done = subprocess.run([sys.executable, "-c", HELP_ALL, *scripts], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_bench_step_smoke(tmp_path):
    out = tmp_path / "step.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_step.py"), "--device", "cpu", "--model", "tiny",
           "--impls", "oomb,oomb-sparse-all,hf", "--lengths", "512,1K", "--chunk-size", "256",
           "--kv-grad-dtype", "bf16", "--checkpoint-layers", "--keep-attention", "fit", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["impl"], r["seq_len"]) for r in rows] == [
        ("oomb", 512), ("oomb", 1024), ("oomb-sparse-all", 512), ("oomb-sparse-all", 1024), ("hf", 512), ("hf", 1024)]
    assert all(r["ok"] and r["tok_s"] > 0 for r in rows)
    # every implementation computes the same loss on the same (seeded) model and data
    losses = {r["seq_len"]: set() for r in rows}
    for r in rows:
        if r["impl"] != "oomb-sparse-all":
            losses[r["seq_len"]].add(r["loss"])
    assert all(len(v) == 1 for v in losses.values()), losses
    assert rows[0]["kv_grad_dtype"] == "bf16" and rows[0]["checkpoint_layers"] is True
    # a CPU model keeps its attention outputs in the host arena (tiny: 2 layers, the last not kept)
    assert (rows[0]["keep_attention"], rows[0]["kept_layers"], rows[0]["kept_where"]) == ("fit", 1, "host")
    assert rows[4]["keep_attention"] is None and "kept_layers" not in rows[4]
    # the pass clock splits an oomb step into its stages: chunks 0 .. n-2 in stage 1, all n in stage 2
    for r in rows[:4]:
        chunks = r["seq_len"] // 256
        assert len(r["stage1_chunk_ms"]) == chunks - 1 and len(r["stage2_chunk_ms"]) == chunks, r
        # all three are rounded to 10 ms
        assert 0.5 * r["step_s"] <= r["stage1_s"] + r["stage2_s"] <= 1.01 * r["step_s"] + 0.015, r
        assert abs(sum(r["stage2_chunk_ms"]) / 1e3 - r["stage2_s"]) <= 0.01 + 0.01 * r["stage2_s"], r
    assert "stage1_s" not in rows[4]


@pytest.mark.parametrize("chunk", ["256", "auto"])
def test_bench_cpu_step_smoke(tmp_path, chunk):
    """An explicit chunk, and by default (auto) the one oomb train chooses for the length."""
    from oomb.auto import chunk_sizes
    from oomb.train.config import TrainConfig

    out = tmp_path / "cpu_step.jsonl"
    given = ["--chunk-size", chunk] if chunk != "auto" else []  # auto: the default
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_cpu_step.py"), "--impls", "oomb,oomb-reference,hf",
           "--lengths", "512", "--repeats", "1", "--out", str(out), *given]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["oomb", "oomb-reference", "hf"]
    want = [int(chunk)] if chunk != "auto" else chunk_sizes(512, TrainConfig().page_size)
    assert rows[0]["chunk_size"] == rows[1]["chunk_size"] and rows[0]["chunk_size"] in want
    assert rows[2]["chunk_size"] is None
    assert all(r["step_s"] > 0 and r["cpu_s"] > 0 and len(r["all_s"]) == 1 for r in rows)


def test_bench_step_profiles_a_window_of_passes(tmp_path):
    """--profile-passes FIRST:COUNT records only some chunk passes (a sample of a long step)."""
    out, prof = tmp_path / "step.jsonl", tmp_path / "prof"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_step.py"), "--device", "cpu", "--model", "tiny",
           "--impls", "oomb-sparse", "--lengths", "1K", "--chunk-size", "128", "--out", str(out),
           "--profile", str(prof), "--profile-passes", "4:2"]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["ok"] and row["profiled"] and row["profile_passes"] == "4:2"
    (trace,) = prof.glob("*.json")
    steps = {e["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if str(e.get("name", "")).startswith("ProfilerStep")}
    assert steps == {"ProfilerStep#5", "ProfilerStep#6"}  # 4 passes waited, 1 warmed up, 2 recorded


def test_bench_parallel_smoke(tmp_path):
    """bench_parallel.py under torchrun (gloo, CPU): 1 process, DP=2 and TP=2 run; TP=2 reads
    the first rank's sequence, so its loss equals the 1-process loss; the report renders them."""
    out = tmp_path / "parallel.jsonl"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    for nproc, tp in ((1, 1), (2, 1), (2, 2)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
               os.path.join(ROOT, "bench", "bench_parallel.py"), "--device", "cpu", "--model", "tiny", "--tp", str(tp),
               "--lengths", "512", "--chunk-size", "128", "--page-size", "32", "--group-pages", "2", "--out", str(out)]
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["world"], r["tp"], r["dp"]) for r in rows] == [(1, 1, 1), (2, 1, 2), (2, 2, 1)]
    assert all(r["ok"] and r["tok_s_per_gpu"] > 0 for r in rows)
    assert rows[2]["loss"] == rows[0]["loss"]
    assert abs(rows[1]["tok_s"] * rows[1]["step_s"] / (2 * 512) - 1) < 0.05  # DP=2: two sequences a step

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from report_common import Commands
    from report_parallel import parallel_table
    lines = parallel_table(rows, Commands()).splitlines()
    header = next(line for line in lines if line.startswith("| attention |")).split(" | ")
    dp2 = next(line for line in lines if line.startswith("| dense | 2 | 1 x 2 |")).split(" | ")
    assert dp2[header.index("DP efficiency")].endswith("%")  # against the 1-process row
    assert "2 pages a call" in dp2[header.index("settings")]


def test_trace_gaps_summary(tmp_path):
    """trace_gaps.py on a hand-made trace: busy time per stream, the compute stream's idle
    time and the part of it the copy streams filled, host waits, the kernels the idle time
    preceded and the host operations during it."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from trace_gaps import load_events, summarize

    def ev(cat, name, ts, dur, stream=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {} if stream is None else {"stream": stream}}
    trace = {"traceEvents": [
        ev("kernel", "attn", 0, 10, 7), ev("kernel", "mlp", 20, 10, 7), ev("kernel", "attn", 40, 10, 7),
        ev("kernel", "copy_rows", 10, 5, 13), ev("gpu_memcpy", "Memcpy HtoD", 35, 3, 13),
        ev("cuda_runtime", "cudaEventSynchronize", 12, 4), ev("cpu_op", "aten::mm", 0, 3),
        {"ph": "i", "name": "marker", "ts": 1},
    ]}
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps(trace))
    s = summarize(load_events(str(tmp_path)))
    assert s["compute_stream"] == 7 and abs(s["span_ms"] - 0.050) < 1e-9
    assert abs(s["compute_idle_ms"] - 0.020) < 1e-9 and abs(s["compute_idle_while_copies_ms"] - 0.008) < 1e-9
    assert abs(s["streams"][7]["busy_frac"] - 0.6) < 1e-9 and s["streams"][7]["top"][0] == ("attn", 0.02)
    assert s["host_waits_ms"] == {"cudaEventSynchronize": 0.004}
    assert s["idle_before_ms"] == [("mlp", 0.01), ("attn", 0.01)]  # gaps 10-20 and 30-40
    assert s["host_during_idle_ms"] == [("cudaEventSynchronize", 0.004)]  # aten::mm ran while attn did
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_gaps.py"), str(path)],
                         check=True, capture_output=True, text=True).stdout
    assert "compute stream 7 idle 0.0 ms" in out and "copy_rows" in out and "idle before these kernels" in out


def test_trace_gaps_gpu_time_by_launching_op():
    """Kernels are charged to the innermost operator around their launch call (with its parent),
    matched by correlation id, per thread; a launch outside any operator is '?'."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from trace_gaps import gpu_time_by_op

    def ev(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [
        ev("cpu_op", "MulBackward0", 0, 100), ev("cpu_op", "aten::mul", 10, 20), ev("cpu_op", "aten::copy_", 50, 20),
        ev("cuda_runtime", "cudaLaunchKernel", 15, 2, correlation=1),
        ev("cuda_runtime", "cudaLaunchKernel", 55, 2, correlation=2),
        ev("cuda_runtime", "cudaMemsetAsync", 80, 2, correlation=3),  # in MulBackward0, after both ops
        ev("cpu_op", "aten::zeros", 0, 10, tid=2), ev("cuda_runtime", "cudaMemsetAsync", 5, 1, tid=2, correlation=4),
        ev("cuda_runtime", "cudaLaunchKernel", 200, 1, correlation=5),
        ev("kernel", "mul_kernel", 20, 4000, stream=7, correlation=1),
        ev("kernel", "copy_kernel", 60, 3000, stream=7, correlation=2),
        ev("gpu_memset", "Memset (Device)", 90, 2000, stream=7, correlation=3),
        ev("gpu_memset", "Memset (Device)", 10, 1000, stream=7, correlation=4),
        ev("kernel", "stray", 300, 500, stream=7, correlation=5),
    ]
    assert dict(gpu_time_by_op(events)) == {
        "MulBackward0 > aten::mul": 4.0, "MulBackward0 > aten::copy_": 3.0, "MulBackward0": 2.0,
        "aten::zeros": 1.0, "?": 0.5}


def test_engine_like_selection_indexes_the_candidates():
    """bench_attention.py --sparse: the chunk's candidates (what the engine's table holds, shared
    by the KV heads), each block's picks ascending indices into them with the sink first."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_attention import HKV, engine_like_selection

    cand, picks = engine_like_selection(8192, 4096, 64, 256, "cpu")
    assert cand.shape == (256,) and cand[0] == 0 and (cand.diff() > 0).all() and cand.max() < 8192
    assert picks.shape == (1, HKV, 32, 64) and picks.dtype == torch.uint8
    p = picks.long()
    assert (p[..., 0] == 0).all() and (p.diff(dim=-1) > 0).all() and p.max() < 256


def test_gpu_meter_averages_nvidia_smi_samples(tmp_path, monkeypatch):
    """bench_step.py's clock and power fields: nvidia-smi runs for the step's GPU (by UUID)
    and its samples average, N/A lines skipped; without CUDA nothing runs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import GpuMeter

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    f'echo "$@" > {tmp_path}/args\n'
                    "echo '1980, 120.5, 0x0000000000000000'\n"
                    "echo '1650, 695.5, 0x0000000000000004'\n"
                    "echo '[N/A], [N/A], [N/A]'\n"
                    "exec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    props = type("Props", (), {"uuid": "1234-abcd"})()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    meter = GpuMeter(cuda=True)
    for _ in range(100):  # until the fake has printed
        if (tmp_path / "args").exists():
            break
        time.sleep(0.05)
    time.sleep(0.2)
    assert meter.summary() == {"sm_mhz": 1815, "power_w": 408, "power_capped": 0.5}
    assert (tmp_path / "args").read_text().split()[:2] == ["-i", "GPU-1234-abcd"]
    assert meter.stop() == "" and GpuMeter(cuda=False).summary() == {}


def test_bench_step_default_is_what_train_chooses(tmp_path):
    """oomb-default builds, for each length, the engine `oomb train` builds with no flags
    (trainer.run_engine_config): the rows record that choice; its loss is the same step's."""
    out = tmp_path / "step.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_step.py"), "--device", "cpu", "--model", "tiny",
           "--impls", "oomb-default,oomb", "--lengths", "1K,4K", "--chunk-size", "256", "--repeats", "2",
           "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["impl"], r["seq_len"]) for r in rows] == [("oomb-default", 1024), ("oomb-default", 4096),
                                                        ("oomb", 1024), ("oomb", 4096)]
    assert all(r["ok"] for r in rows)
    # --repeats: each timed step recorded, the row's time their median (of two: the mean)
    assert all(len(r["step_times"]) == 2 and abs(r["step_s"] - sum(r["step_times"]) / 2) <= 0.006 for r in rows)
    # a CPU run plans in host memory: the largest chunk that leaves two (at most half the sequence)
    assert [r["chunk_size"] for r in rows[:2]] == [512, 2048]
    assert all(r["auto"].startswith("auto configuration: chunk") and r["kv_grad_dtype"] == "fp32"
               and r["checkpoint_layers"] is False for r in rows[:2])
    for default, fixed in zip(rows[:2], rows[2:]):  # the same tokens: chunking changes the rounding only
        assert abs(default["loss"] - fixed["loss"]) <= 1e-4 * fixed["loss"]


def test_bench_step_packed_documents_equal_separate_sequences(tmp_path):
    """--packed-docs: oomb steps packed documents (position_ids, each attends to itself) and
    transformers the same tokens as a batch of separate sequences: the same loss."""
    out = tmp_path / "step.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_step.py"), "--device", "cpu", "--model", "tiny",
           "--impls", "oomb,hf", "--lengths", "1K", "--chunk-size", "256", "--packed-docs", "256", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["impl"], r["packed_docs"]) for r in rows] == [("oomb", 256), ("hf", 256)] and all(r["ok"] for r in rows)
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-4 * rows[1]["loss"]


def test_before_after_tells_a_changed_gradient(tmp_path):
    """bench/before_after.py runs one step per source tree in its own process and compares the
    gradients bit for bit: an earlier tree whose layers scale their output by 1.0001 differs, and
    the row names the parameters (the embedding's gradient is the first in the model's order)."""
    shutil.copytree(os.path.join(ROOT, "src"), tmp_path / "before" / "src")
    base = tmp_path / "before" / "src" / "oomb" / "models" / "base.py"
    text = base.read_text()
    line = "        return h + self.mlp(layer, layer.post_attention_layernorm(h))"
    assert line in text
    base.write_text(text.replace(line, "        return (h + self.mlp(layer, layer.post_attention_layernorm(h))) * 1.0001"))
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "before_after.py"), "--before",
                           str(tmp_path / "before"), "--before-commit", "scaled", "--device", "cpu", "--model", "tiny",
                           "--lengths", "512", "--chunk-size", "128", "--page-size", "64", "--backend", "torch",
                           "--offload", "all", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = (json.loads(line) for line in out.read_text().splitlines())
    assert (before["tree"], before["commit"], after["tree"]) == ("before", "scaled", "after")
    assert before["ok"] and after["ok"] and before["grad_sha256"] != after["grad_sha256"]
    assert after["grads_equal_before"] is False and "model.embed_tokens.weight" in after["differing_params"]
    assert after["time_vs_before"] > 0 and before["host_layers"] == after["host_layers"] > 0


def test_bench_step_times_oomb_train_itself(tmp_path):
    """oomb-train runs `oomb train` with no tuning flags: its row holds every step's time from
    metrics.jsonl, the median of those after the first, and the same automatic choice as the
    engine-only oomb-default step at that length."""
    out = tmp_path / "step.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_step.py"), "--device", "cpu", "--model", "tiny",
           "--impls", "oomb-default,oomb-train", "--lengths", "1K", "--train-steps", "4", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    engine, trainer = [json.loads(line) for line in out.read_text().splitlines()]
    assert trainer["impl"] == "oomb-train" and trainer["ok"] and trainer["layers"] == 2
    times = trainer["trainer_step_s"]
    assert len(times) == 4 and trainer["step_s"] == sorted(times[1:])[1]
    assert trainer["auto"].split(" (chosen")[0] == engine["auto"].split(" (chosen")[0]
    capped = subprocess.run(cmd + ["--gpu-cap-gib", "24"], env=env, capture_output=True, text=True, timeout=600)
    assert capped.returncode and "leave them out of a run with --gpu-cap-gib" in capped.stderr
