"""Checkpoints a user can trust: nothing in them runs as code, a failed or killed save leaves the
previous checkpoint whole and resumable, every write reaches the disk before it is published."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oomb.train import checkpoint, durable
from oomb.train.checkpoint import SaveFailed
from oomb.train.config import TrainConfig
from oomb.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=4, backend="torch", device="cpu")


def steps_logged(output_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def tiny_save(output_dir, step: int) -> Path:
    """A real checkpoint of a 2-parameter model, without the trainer (milliseconds)."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return checkpoint.save(output_dir, step, model, optimizer, scheduler, TrainConfig())


def test_a_payload_planted_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    """A pickled object whose unpickling runs code (here: exec writing a marker file), added to an
    optimizer or RNG file whose manifest entry is then re-hashed, is refused with a message
    naming the file and the call; the code never runs."""
    train(TrainConfig(**{**SMALL, "steps": 2}, output_dir=str(tmp_path / "run"), save_every=2))
    ckpt = tmp_path / "run" / "step-000002"
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    for name in ("optimizer.pt", "rng-rank0.pt"):
        whole = (ckpt / name).read_bytes()
        content = torch.load(ckpt / name, weights_only=True)
        torch.save({**content, "extra": Payload()}, ckpt / name)
        checkpoint._write_manifest(ckpt)  # the manifest proves the files are intact, not who wrote them
        checkpoint.verify(ckpt)
        with pytest.raises(ValueError, match=rf"{name} holds a call to exec; oomb loads only tensors from a "
                                             "checkpoint and runs no code from one"):
            train(TrainConfig(**SMALL, resume=str(ckpt)))
        assert not marker.exists()
        (ckpt / name).write_bytes(whole)
        checkpoint._write_manifest(ckpt)
    torch.save({"extra": Payload()}, tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)  # the payload is live: unpickled, it runs
    assert marker.read_text() == "ran"


def test_tensor_parallel_optimizer_state_is_plain_tensors_and_placements(tmp_path):
    """DTensor optimizer state (tensor parallelism) is saved as each rank's local tensors with
    their placements in JSON, read with weights_only=True and rebuilt as DTensors equal to the
    saved ones (one gloo process here; tests/test_parallel.py resumes a 2-rank --tp run)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def make(placement=Shard(0)):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 6)
            for name, p in list(model.named_parameters()):
                setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))
            optimizer = torch.optim.AdamW(model.parameters())
            return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

        model, optimizer, scheduler = make()
        for p in model.parameters():
            p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
        optimizer.step()
        path = checkpoint.save(tmp_path, 1, model, optimizer, scheduler, TrainConfig())
        saved = torch.load(path / "optimizer-rank0.pt", weights_only=True)
        assert not any(isinstance(v, DTensor) for entry in saved["optimizer"]["state"].values() for v in entry.values())
        assert json.loads(saved["dtensors"])["0/exp_avg"] == {"placements": [["shard", 0]], "shape": [6, 4],
                                                               "stride": [4, 1]}
        model2, optimizer2, scheduler2 = make()
        assert checkpoint.load(path, model2, optimizer2, scheduler2) == 1
        for p, p2 in zip(model.parameters(), model2.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = optimizer2.state[p2][key], optimizer.state[p][key]
                assert isinstance(got, DTensor) and got.placements == want.placements
                assert torch.equal(got.full_tensor(), want.full_tensor())
        with pytest.raises(ValueError, match=r"optimizer-rank0.pt holds optimizer state split as \[\['shard', 0\]\], "
                                             "this run does not split that parameter so: resume with the --tp it was "
                                             "written with"):
            checkpoint.load(path, *make(Replicate()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fault", ["rename", "tensor writer", "disk full", "no room"])
def test_a_failed_save_keeps_the_previous_checkpoint_and_stops_in_one_line(tmp_path, monkeypatch, fault):
    """The save of step 4 fails: os.replace raising as it publishes, the tensor writer raising
    halfway through its file, the disk filling up (ENOSPC from the writer), or too little free
    space before writing. The run stops with one line naming the last good checkpoint (step 2);
    nothing of step 4 is left; step 2 verifies and the run resumes from it to the end."""
    out = tmp_path / "run"
    real_replace, real_save_file = os.replace, checkpoint.save_file

    def replace(src, dst):
        if Path(dst).name == "step-000004":
            raise OSError(errno.EIO, "Input/output error")
        return real_replace(src, dst)

    def save_file(state, path):
        if "step-000004" not in str(path):
            return real_save_file(state, path)
        Path(path).write_bytes(b"\0" * 1000)  # the first part of the file, then the failure
        if fault == "disk full":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("file write failed")

    frees = iter([2**50])  # room for step 2, 10 bytes for step 4

    def disk_usage(path):
        return SimpleNamespace(free=next(frees, 10))

    if fault == "rename":
        monkeypatch.setattr(os, "replace", replace)
    elif fault == "no room":
        monkeypatch.setattr(durable.shutil, "disk_usage", disk_usage)
    else:
        monkeypatch.setattr(checkpoint, "save_file", save_file)
    with pytest.raises(SaveFailed) as failed:
        train(TrainConfig(**SMALL, output_dir=str(out), save_every=2))
    message = str(failed.value)
    why = {"rename": r"\[Errno 5\] Input/output error", "tensor writer": "file write failed",
           "disk full": r"\[Errno 28\] No space left on device",
           "no room": rf"\[Errno 28\] needs [\d.]+ GiB, 0.00 GiB is free in {out}"}[fault]
    good = out / "step-000002"
    assert "\n" not in message
    assert re.match(rf"the checkpoint of step 4 was not written \({why}.*\); the last good checkpoint is {good}: "
                    rf"fix the cause \(free space\?\) and resume with --resume {good}$", message)
    assert checkpoint.step_dirs(out) == [good] and not list(out.glob("*.tmp*"))
    monkeypatch.undo()
    checkpoint.verify(good)
    assert checkpoint.latest(out) == good
    train(TrainConfig(**SMALL, output_dir=str(out), save_every=2, resume="latest"))
    assert checkpoint.latest(out) == out / "step-000004" and steps_logged(out) == [1, 2, 3, 4]


KILLED_IN_SAVE = """
import sys, time
from pathlib import Path
from oomb.train import checkpoint
from oomb.train.config import TrainConfig
from oomb.train.trainer import train
real = checkpoint.save_file

def save_file(state, path):
    if "step-000004" not in str(path):
        return real(state, path)
    Path(path).write_bytes(b"\\0" * 1000)
    Path(sys.argv[2]).write_text("saving")
    time.sleep(600)

checkpoint.save_file = save_file
train(TrainConfig(seq_len=256, chunk_size=128, page_size=64, steps=4, backend="torch", device="cpu",
                  output_dir=sys.argv[1], save_every=2))
"""


def test_a_run_killed_while_saving_leaves_the_previous_checkpoint_resumable(tmp_path, capsys):
    """SIGKILL in the middle of writing step 4's checkpoint: no step-000004 appears (only its
    temporary directory), step 2 is the newest verified checkpoint, and `--resume latest`
    removes the leftover, continues from step 2, and metrics.jsonl holds each step once."""
    out, saving = tmp_path / "run", tmp_path / "saving"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, "-c", KILLED_IN_SAVE, str(out), str(saving)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not saving.exists():
        assert run.poll() is None and time.time() < deadline, run.communicate()
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=60)
    assert [p.name for p in checkpoint.step_dirs(out)] == ["step-000002"]
    (leftover,) = out.glob("step-000004.tmp-*")
    assert checkpoint.latest(out) == out / "step-000002"
    train(TrainConfig(**SMALL, output_dir=str(out), save_every=2, resume="latest"))
    log = capsys.readouterr().out
    assert f"--resume latest: {out / 'step-000002'}" in log and f"removed what a killed run left in {out}" in log
    assert not leftover.exists() and steps_logged(out) == [1, 2, 3, 4]
    checkpoint.verify(out / "step-000004")


def test_files_the_temporary_directory_and_its_parent_are_fsynced(tmp_path, monkeypatch):
    """Every file of a checkpoint and of final/ is flushed under its temporary name, then the
    temporary directory, then (after the rename) the output directory."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "run"
    train(TrainConfig(**{**SMALL, "steps": 1}, output_dir=str(out)))
    for final in (out / "step-000001", out / "final"):
        tmp = [p for p in synced if p.name.startswith(final.name + ".tmp-")]
        assert len(set(tmp)) == 1, tmp  # the temporary directory itself
        files = {p.relative_to(final) for p in final.rglob("*") if p.is_file()}
        assert files and files <= {p.relative_to(tmp[0]) for p in synced if p.is_relative_to(tmp[0])}
        assert out in synced[synced.index(tmp[0]) + 1 :]  # the parent, after the rename


def test_a_replaced_directory_is_renamed_aside_and_put_back_after_a_failure(tmp_path, monkeypatch):
    """publish() over an existing directory: renamed aside, the new one renamed in, the old one
    removed. A rename that fails puts the old one back; a kill between the two renames leaves it
    aside, and clean_stale() (at the next run's start) puts it back."""
    final, tmp = tmp_path / "final", tmp_path / "final.tmp-1"
    final.mkdir()
    (final / "a").write_text("old")

    def new():
        tmp.mkdir()
        (tmp / "a").write_text("new")

    real = os.replace
    new()
    monkeypatch.setattr(os, "replace", lambda src, dst: real(src, dst) if Path(src) != tmp else 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a kill: nothing after it runs
        durable.publish(tmp, final)
    (aside,) = tmp_path.glob("final.old-*")
    assert not final.exists() and tmp.exists()
    assert sorted(durable.clean_stale(tmp_path)) == [aside.name, tmp.name]
    assert (final / "a").read_text() == "old" and not tmp.exists()
    new()
    monkeypatch.setattr(os, "replace", lambda src, dst: real(src, dst) if Path(src) != tmp else
                        (_ for _ in ()).throw(OSError(errno.EXDEV, "Invalid cross-device link")))
    with pytest.raises(OSError, match="cross-device"):
        durable.publish(tmp, final)
    assert (final / "a").read_text() == "old" and not list(tmp_path.glob("final.old-*"))
    monkeypatch.setattr(os, "replace", real)
    durable.publish(tmp, final)
    assert (final / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_latest_is_the_newest_verified_checkpoint_by_step_number(tmp_path):
    """step-1000000 is newer than step-999999 (not so as text); a damaged newest checkpoint is
    passed over with a warning for the one before it; unfinished and temporary ones never count."""
    assert checkpoint.latest(tmp_path) is None and checkpoint.latest(tmp_path / "absent") is None
    for step in (2, 999_999, 1_000_000):
        tiny_save(tmp_path, step)
    (tmp_path / "step-2000000.tmp-1-ab").mkdir()
    (tmp_path / "step-3000000").mkdir()  # no manifest: never finished
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1000000"
    (tmp_path / "step-1000000" / "model.safetensors").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match=r"step-1000000: model.safetensors has 7 bytes.*passed over for an earlier"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-999999"


def test_save_total_limit_deletes_the_oldest_only_after_a_verified_save(tmp_path):
    for step in (1, 2, 3):
        tiny_save(tmp_path, step)
    newest = tiny_save(tmp_path, 10)
    assert checkpoint.prune(tmp_path, 2, newest) == [tmp_path / "step-000001", tmp_path / "step-000002"]
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-000003", "step-000010"]
    newest = tiny_save(tmp_path, 11)
    (newest / "trainer.json").write_text("{}")  # not what its manifest says: nothing is deleted
    with pytest.warns(UserWarning, match="--save-total-limit 1: older checkpoints kept"):
        assert checkpoint.prune(tmp_path, 1, newest) == []
    assert len(checkpoint.step_dirs(tmp_path)) == 3
