"""Runs that survive interruption: signals, exact resume, checkpoint integrity, non-finite steps."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from oomb.train import checkpoint
from oomb.train.config import TrainConfig
from oomb.train.interrupt import Interrupt, TrainingStopped
from oomb.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=4, backend="torch", device="cpu")
ARGS = ["--steps", "6", "--seq-len", "1024", "--chunk-size", "256", "--page-size", "64", "--backend", "torch",
        "--device", "cpu", "--lr", "1e-2"]


def cli(*args):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "oomb.cli", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def losses(output_dir) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def interrupted_and_uninterrupted(tmp_path, args: list[str], steps: int = 6) -> tuple[dict, dict]:
    """A real SIGTERM after two logged steps of `oomb train *args`: the step in progress is
    abandoned, the last finished one checkpointed, exit 143 with the command to resume; then the
    run resumed to the end, and the same run uninterrupted. Returns both runs' losses by step."""
    run = cli(*args, "--output-dir", str(tmp_path / "run"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 143, (out, err)
    assert "SIGTERM received" in err and "stopped by SIGTERM after step" in out
    step = int(out.split("stopped by SIGTERM after step ")[1].split()[0])
    assert 2 <= step < steps
    ckpt = tmp_path / "run" / f"step-{step:06d}"
    assert f"resume with: oomb train {' '.join(args)} --output-dir {tmp_path / 'run'} --resume {ckpt}" in out
    assert (ckpt / "manifest.json").is_file() and not list((tmp_path / "run").glob("*.tmp*"))
    resumed = cli(*args, "--output-dir", str(tmp_path / "run"), "--resume", str(ckpt))
    out = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    reference = cli(*args, "--output-dir", str(tmp_path / "ref"))
    out = reference.communicate(timeout=600)
    assert reference.returncode == 0, out
    ref = losses(tmp_path / "ref")
    assert sorted(ref) == list(range(1, steps + 1)) and sorted(losses(tmp_path / "run")) == sorted(ref)
    return losses(tmp_path / "run"), ref


def test_sigterm_checkpoints_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """Resumed after a SIGTERM, every step's loss equals the uninterrupted run's, bit for bit (the
    runs have one thread each: with two, on a busy 2-core machine, CPU reductions were seen to
    round differently from one process to another)."""
    resumed, ref = interrupted_and_uninterrupted(tmp_path, ARGS)
    assert resumed == ref


@pytest.mark.gpu
def test_resumed_run_on_the_gpu_equals_the_uninterrupted_one(tmp_path):
    """The same on CUDA with the Triton kernels (dK/dV summed without atomics, a fixed order):
    the resumed run's losses are the uninterrupted run's, bit for bit."""
    args = ["--steps", "6", "--seq-len", "16384", "--chunk-size", "4096", "--device", "cuda", "--lr", "1e-3"]
    resumed, ref = interrupted_and_uninterrupted(tmp_path, args)
    print("max |loss difference| over steps:", max(abs(resumed[s] - ref[s]) for s in ref))
    assert resumed == ref


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args):
    """`torchrun --nproc-per-node 2 -m oomb.cli train *args` on gloo (CPU), one thread a rank."""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "-m", "oomb.cli", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_under_torchrun_stops_both_ranks_mid_step_and_resumes_exactly(tmp_path):
    """torchrun forwards SIGTERM to the ranks and kills them 30 s later. Sent a quarter into step
    2 (31 chunk passes), the two data-parallel ranks agree on a chunk boundary of that step,
    abandon it, checkpoint step 1 and exit within seconds; resumed, the run's losses equal an
    uninterrupted run's, bit for bit. Without the agreement after each chunk pass the ranks
    would finish step 2 first."""
    args = ["--steps", "2", "--seq-len", "2048", "--chunk-size", "128", "--page-size", "64", "--backend", "torch",
            "--lr", "1e-2"]
    run = torchrun(*args, "--output-dir", str(tmp_path / "run"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().endswith("\n")):
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.02)
    time.sleep(json.loads(metrics.read_text())["step_s"] / 4)  # into step 2
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=60)
    stop_s = time.monotonic() - sent
    ckpt = tmp_path / "run" / "step-000001"
    assert f"stopped by SIGTERM after step 1 of 2; checkpoint {ckpt}" in out, (out, err)
    assert stop_s < 15, stop_s  # torchrun's SIGKILL comes at 30 s
    assert sorted(losses(tmp_path / "run")) == [1] and (ckpt / "manifest.json").is_file()
    assert "forcefully exiting via SIGKILL" not in err
    resumed = torchrun(*args, "--output-dir", str(tmp_path / "run"), "--resume", str(ckpt))
    reference = torchrun(*args, "--output-dir", str(tmp_path / "ref"))
    for p in (resumed, reference):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    ref = losses(tmp_path / "ref")
    assert sorted(ref) == [1, 2] and losses(tmp_path / "run") == ref


def test_second_signal_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    interrupt = Interrupt(announce=False)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.requested and interrupt.name == "SIGINT" and not exits
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM]
    finally:
        interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _agreement_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    from oomb.parallel import host_group, init_distributed

    mesh = init_distributed(timeout_s=60)
    groups = {"world": torch.distributed.group.WORLD, "dp": mesh["dp"].get_group(), "tp": mesh["tp"].get_group()}
    timeouts = {name: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for name, g in groups.items()}
    interrupt = Interrupt(announce=False)
    answers = [interrupt.agreed(host_group())]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # this rank only
    answers += [interrupt.agreed(host_group()), interrupt.agreed(host_group())]
    interrupt.restore()
    torch.save({"answers": answers, "signal": interrupt.name, "timeouts": timeouts}, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def test_a_signal_on_one_rank_stops_every_rank_and_every_group_has_the_timeout(tmp_path):
    """The stop flag is all-reduced: a rank that got no signal stops with the one that did, at the
    same call, the one after the signal's (each call reads the flag the one before sent). Every
    process group (the mesh's too) has --process-group-timeout, not torch's default."""
    import torch.multiprocessing as mp
    mp.spawn(_agreement_worker, args=(free_port(), str(tmp_path / "rank")), nprocs=2, join=True)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"rank.{rank}") == {"answers": [False, False, True], "signal": "SIGTERM",
                                                         "timeouts": {"world": 60, "dp": 60, "tp": 60}}


def test_shutdown_timeout_exits_when_the_stop_takes_too_long(monkeypatch, capsys):
    """--shutdown-timeout: the time a stop gets from the signal; past it the run says so, naming its
    newest checkpoint, and exits with 128 + signal (before torchrun's SIGKILL could). The measured
    pass and checkpoint times warn once, ahead, when a stop could not fit."""
    interrupt = Interrupt(shutdown_timeout_s=25)
    interrupt.restore()
    interrupt.check_time(pass_s=0.3, passes=4, save_s=20)
    assert "warning" not in capsys.readouterr().err
    interrupt.check_time(pass_s=0.3, passes=4, save_s=43)
    interrupt.check_time(pass_s=0.3, passes=4, save_s=43)
    assert capsys.readouterr().err.count("warning: a stop on SIGTERM could take 44 s here (4 chunk passes of 0.3 s, "
                                         "a checkpoint of 43 s), more than --shutdown-timeout 25") == 1
    exits = []
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code))
    interrupt = Interrupt(shutdown_timeout_s=0.2)
    try:
        interrupt.newest_checkpoint = "runs/a/step-000007"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        assert exits == [128 + signal.SIGTERM]
        assert ("SIGTERM 0.2 s ago and the checkpoint is not written (--shutdown-timeout): exiting without it; the "
                "newest checkpoint is runs/a/step-000007") in capsys.readouterr().err
    finally:
        interrupt.restore()
    exits.clear()
    interrupt = Interrupt(shutdown_timeout_s=0.2)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        interrupt.disarm()  # the checkpoint was written in time
        time.sleep(0.5)
        assert exits == []
    finally:
        interrupt.restore()


def test_shutdown_and_process_group_timeouts_are_checked():
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"shutdown_timeout=.* must be a number of seconds >= 0 \(0: no limit\)"):
            TrainConfig(shutdown_timeout=bad)
    for bad in (0, float("nan")):
        with pytest.raises(ValueError, match=r"process_group_timeout=.* must be a number of seconds > 0"):
            TrainConfig(process_group_timeout=bad)


def test_checkpoint_integrity_names_the_damaged_file(tmp_path):
    train(TrainConfig(**SMALL, output_dir=str(tmp_path), save_every=2, offload="all"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["host_rss_gib"] > 0 and r["pinned_gib"] > 0 for r in rows)  # memory after every step (soak)
    ckpt = tmp_path / "step-000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"model.safetensors", "optimizer.pt", "trainer.json", "rng-rank0.pt"} <= set(manifest)
    checkpoint.verify(ckpt)
    model = ckpt / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit flipped: same size
    model.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors is corrupted"):
        train(TrainConfig(**SMALL, resume=str(ckpt)))
    data[len(data) // 2] ^= 0x10
    model.write_bytes(bytes(data))
    checkpoint.verify(ckpt)  # whole again
    opt = ckpt / "optimizer.pt"
    whole = opt.read_bytes()
    opt.write_bytes(whole[:100])
    with pytest.raises(ValueError, match=r"optimizer.pt has 100 bytes, the manifest says [\d,]+ \(truncated"):
        checkpoint.verify(ckpt)
    opt.write_bytes(whole)
    (ckpt / "rng-rank0.pt").unlink()
    with pytest.raises(ValueError, match="incomplete: rng-rank0.pt is missing"):
        checkpoint.verify(ckpt)


def test_resume_with_another_configuration_is_refused(tmp_path):
    train(TrainConfig(**SMALL, output_dir=str(tmp_path), save_every=2))
    with pytest.raises(ValueError, match=r"another run configuration \(seq_len: 256 there, 512 here; "
                                         r"lora_rank: 0 there, 4 here\)"):
        train(TrainConfig(**{**SMALL, "seq_len": 512}, lora_rank=4, resume=str(tmp_path / "step-000002")))


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch, capsys):
    """A NaN gradient skips the optimizer step (weights unchanged, counted in metrics.jsonl); three
    in a row stop the run with a checkpoint of the last good weights and a clear message."""
    from oomb.engine import ChunkRecurrentEngine
    real = ChunkRecurrentEngine.forward_backward
    calls = {"n": 0}
    poisoned = {2, 4, 5, 6}

    def forward_backward(self, *args, **kwargs):
        calls["n"] += 1
        result = real(self, *args, **kwargs)
        if calls["n"] in poisoned:
            next(p for p in self.model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        return result

    monkeypatch.setattr(ChunkRecurrentEngine, "forward_backward", forward_backward)
    weights = []
    step = torch.optim.AdamW.step

    def record(self, *a, **k):
        weights.append(self.param_groups[0]["params"][0].detach().clone())
        return step(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    with pytest.raises(TrainingStopped, match=r"3 steps in a row had a non-finite loss or gradient norm \(steps 4-6\); "
                                             r"the weights of step 3 are in .*step-000006"):
        train(TrainConfig(**{**SMALL, "steps": 8}, output_dir=str(tmp_path)))
    assert len(weights) == 2  # optimizer steps 1 and 3 only
    out = capsys.readouterr().out
    assert "step 2: loss" in out and "not finite, optimizer step skipped (1 in a row" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped")] == [2, 4, 5, 6]
    assert [r["bad_in_a_row"] for r in rows if r.get("skipped")] == [1, 1, 2, 3]
    assert (tmp_path / "step-000006" / "manifest.json").is_file()

