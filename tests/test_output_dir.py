"""The output directory: a previous run is never overwritten or appended to unasked, one run at a
time, --resume latest / auto, --save-total-limit, and a run that saves nothing says so first."""
import json
import os
import subprocess
import sys

import pytest

from oomb.train import checkpoint, trainer
from oomb.train.config import TrainConfig
from oomb.train.output_dir import Lock
from oomb.train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=2, backend="torch", device="cpu")


@pytest.fixture
def no_compute(monkeypatch):
    """Refusals come before the model is built."""
    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")
    monkeypatch.setattr(trainer, "build_model", build_model)


def test_a_previous_run_is_refused_before_compute(tmp_path, no_compute):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (tmp_path / "step-000001").mkdir()
    with pytest.raises(ValueError, match=rf"--output-dir {tmp_path} holds a previous run \(metrics.jsonl, "
                                         r"step-000001\); continue it with --resume latest, or replace it with "
                                         r"--overwrite, or give another --output-dir"):
        train(TrainConfig(**SMALL, output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"--overwrite deletes .* and --resume latest continues one: give one"):
        train(TrainConfig(**SMALL, output_dir=str(tmp_path), overwrite=True, resume="latest"))
    with pytest.raises(ValueError, match=rf"--resume latest: {tmp_path} holds no finished checkpoint .*; start "
                                         "without --resume, or use --resume auto"):
        train(TrainConfig(**SMALL, output_dir=str(tmp_path), resume="latest"))
    with pytest.raises(ValueError, match="--resume latest takes the newest checkpoint in --output-dir, and none is "
                                         "given: add --output-dir DIR"):
        train(TrainConfig(**SMALL, resume="latest"))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path, no_compute):
    lock = Lock(tmp_path)  # what a live run holds
    try:
        with pytest.raises(ValueError, match=rf"--output-dir {tmp_path} is in use by another run \(process "
                                             rf"{os.getpid()} holds {tmp_path}/.lock\); wait for it to end, or give "
                                             "another --output-dir"):
            train(TrainConfig(**SMALL, output_dir=str(tmp_path)))
    finally:
        lock.release()
    Lock(tmp_path).release()  # free again


def test_the_lock_stops_a_second_process(tmp_path):
    """Two `oomb train` processes into one directory: the second is refused in one line while the
    first one holds the lock (the lock dies with its process)."""
    code = ("import sys, time; from oomb.train.output_dir import Lock; Lock(__import__('pathlib').Path(sys.argv[1])); "
            "print('locked', flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        second = subprocess.run([sys.executable, "-m", "oomb.cli", "train", "--output-dir", str(tmp_path)], env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 1 and second.stderr.count("\n") == 1
        assert second.stderr.startswith(f"oomb train: error: --output-dir {tmp_path} is in use by another run "
                                        f"(process {holder.pid} holds")
    finally:
        holder.kill()
        holder.wait()
    Lock(tmp_path).release()


def test_overwrite_replaces_the_previous_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 7, "loss": 5.0}\n')
    (tmp_path / "step-000007").mkdir()
    (tmp_path / "notes.txt").write_text("mine")  # not a run's file: kept, and no reason to refuse
    train(TrainConfig(**SMALL, output_dir=str(tmp_path), overwrite=True))
    assert "--overwrite: deleted the previous run's metrics.jsonl, step-000007" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "config.yaml", "final", "metrics.jsonl",
                                                          "notes.txt", "step-000002"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_auto_starts_fresh_without_a_checkpoint_and_resumes_with_one(tmp_path, capsys):
    """--resume auto: step 0 when the directory holds no checkpoint (the rows a run killed before
    its first save logged are dropped), the newest verified checkpoint otherwise; with
    --save-total-limit 1 only the newest checkpoint is left."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')  # killed mid-row
    cfg = dict(**{**SMALL, "steps": 3}, output_dir=str(tmp_path), save_every=1, save_total_limit=1, resume="auto")
    train(TrainConfig(**cfg))
    out = capsys.readouterr().out
    assert f"--resume auto: no checkpoint in {tmp_path}, from step 0" in out and "deleted" in out
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-000003"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["loss"] != 5.0
    losses = train(TrainConfig(**{**cfg, "steps": 4}))
    assert len(losses) == 1 and f"--resume auto: {tmp_path / 'step-000003'}" in capsys.readouterr().out
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-000004"]


@pytest.mark.parametrize("save_every", [0, 2])
def test_a_run_without_output_dir_says_first_that_nothing_is_saved(capsys, save_every):
    train(TrainConfig(**{**SMALL, "steps": 1}, save_every=save_every))
    first = capsys.readouterr().out.splitlines()[0]
    if save_every:
        assert first == ("oomb train: warning: --save-every 2 without --output-dir: nothing will be saved (no "
                         "checkpoint, no metrics.jsonl, no final model); add --output-dir DIR")
    else:
        assert first == ("oomb train: no --output-dir: nothing will be saved (no checkpoint, no metrics.jsonl, no "
                         "final model)")


def test_new_flags_reach_the_command_line(capsys):
    from oomb.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--save-total-limit", "-1"])
    assert "argument --save-total-limit: -1 must be >= 0" in capsys.readouterr().err
