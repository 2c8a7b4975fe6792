"""oomb.train(config, callbacks=[...]) and --report-to: the hooks' order and arguments against
metrics.jsonl, a stop asked by a hook, TensorBoard's event files read back, and a missing
tracker refused before any compute (tiny preset, CPU)."""
import dataclasses
import json
import os
import sys
import types

import numpy as np
import pytest

import oomb
from oomb.cli import main
from oomb.train import trainer
from oomb.train.callbacks import tracker_names

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, backend="torch", device="cpu")


class Recorder(oomb.Callback):
    """Every hook call, in order; `stop_at`: (hook, step) at which to return True."""

    def __init__(self, stop_at=None):
        self.calls, self.stop_at = [], stop_at

    def on_train_begin(self, step, config):
        self.calls.append(("begin", step, config))

    def on_step_end(self, step, metrics):
        self.calls.append(("step", step, metrics))
        return self.stop_at == ("step", step)

    def on_evaluate(self, step, results):
        self.calls.append(("eval", step, results))
        return self.stop_at == ("eval", step)

    def on_save(self, step, path):
        self.calls.append(("save", step, path))
        return self.stop_at == ("save", step)

    def on_train_end(self):
        self.calls.append(("end",))


def rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_callbacks_are_called_in_order_with_the_metrics_rows(tmp_path):
    cfg = oomb.TrainConfig(**SMALL, steps=3, eval_every=2, save_every=2, output_dir=str(tmp_path))
    rec = Recorder()
    losses = oomb.train(cfg, callbacks=[rec])
    assert [c[:2] for c in rec.calls] == [("begin", 0), ("step", 1), ("step", 2), ("eval", 2), ("save", 2),
                                         ("step", 3), ("eval", 3), ("save", 3), ("end",)]
    # the step and evaluation hooks get metrics.jsonl's rows, in its order
    assert [c[2] for c in rec.calls if c[0] in ("step", "eval")] == rows(tmp_path)
    assert [c[2]["loss"] for c in rec.calls if c[0] == "step"] == losses
    assert [c[2] for c in rec.calls if c[0] == "save"] == [str(tmp_path / "step-000002"), str(tmp_path / "step-000003")]
    # the configuration: cfg's fields, with what it left to the run as the run decided it
    config = rec.calls[0][2]
    decided = {"kv_grad_dtype", "checkpoint_layers", "compile", "dtype", "device", "backend", "chunk_size"}
    assert {k: v for k, v in config.items() if k not in decided} == \
        {k: v for k, v in dataclasses.asdict(cfg).items() if k not in decided}
    assert (config["kv_grad_dtype"], config["dtype"], config["device"], config["backend"]) == \
        ("float32", "float32", "cpu", "torch")
    assert cfg.kv_grad_dtype == "auto" and isinstance(config["checkpoint_layers"], bool)
    json.dumps(config)  # plain values, as the trackers take them


@pytest.mark.parametrize("stop_at", [("step", 2), ("eval", 2), ("save", 2)])
def test_a_callback_stops_the_run_like_a_normal_end(tmp_path, stop_at, capsys):
    """A hook returning True at step 2 of 5: step 2 is the run's last; it is evaluated, saved and
    exported as the last step of a 2-step run would be (on_save's stop comes after the step's
    evaluation point: evaluated only when --eval-every says so), and the run returns normally."""
    every = {"eval": dict(eval_every=2), "save": dict(save_every=2)}.get(stop_at[0], {})
    cfg = oomb.TrainConfig(**SMALL, steps=5, output_dir=str(tmp_path), **{"eval_every": 10, **every})
    rec = Recorder(stop_at)
    losses = oomb.train(cfg, callbacks=[rec])
    assert len(losses) == 2
    evaluated = stop_at[0] != "save"
    assert [c[:2] for c in rec.calls] == [("begin", 0), ("step", 1), ("step", 2), *[("eval", 2)] * evaluated,
                                         ("save", 2), ("end",)]
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 2][: 2 + evaluated]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "config.yaml", "final", "metrics.jsonl", "step-000002"]
    hook = {"step": "on_step_end", "eval": "on_evaluate", "save": "on_save"}[stop_at[0]]
    assert f"Recorder.{hook} asked the run to stop: step 2 is its last" in capsys.readouterr().out


def test_tensorboard_event_files_hold_the_metrics_rows(tmp_path):
    """--report-to tensorboard: TensorBoard's own reader finds every row of metrics.jsonl (steps and
    values; TensorBoard keeps float32) and the configuration; a resumed run's events replace those
    after its step, as its metrics.jsonl rows do."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = oomb.TrainConfig(**SMALL, steps=3, eval_every=2, save_every=2, lora_rank=4, output_dir=str(tmp_path),
                           report_to="tensorboard")
    oomb.train(cfg)
    oomb.train(dataclasses.replace(cfg, resume="latest"))  # step 3 again, from step 2's checkpoint

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    table = rows(tmp_path)
    assert [r["step"] for r in table] == [1, 2, 2, 3, 3]
    for name in ("loss", "grad_norm", "lr", "eval_loss", "eval_tokens"):
        logged = [(r["step"], float(np.float32(r[name]))) for r in table if name in r]
        assert [(e.step, e.value) for e in events.Scalars(name)] == logged, name
    assert "config/text_summary" in events.Tags()["tensors"]


TRACKER_MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow",
                   "trackio": "trackio"}


@pytest.mark.parametrize("name", sorted(TRACKER_MODULES))
def test_a_missing_tracker_is_an_error_before_any_compute(tmp_path, monkeypatch, capsys, name):
    monkeypatch.setitem(sys.modules, TRACKER_MODULES[name], None)  # import fails as for a package not installed

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")
    monkeypatch.setattr(trainer, "build_model", build_model)
    out = tmp_path / "run"
    cfg = oomb.TrainConfig(**SMALL, steps=1, output_dir=str(out), report_to=name)
    with pytest.raises(ValueError, match=rf"--report-to {name} needs the {name} package, which is not installed "
                                         rf".*; pip install 'oomb\[{name}\]' \(or pip install {name}\)"):
        oomb.train(cfg)
    assert not out.exists()  # not even the output directory
    with pytest.raises(SystemExit, match=rf"oomb train: error: --report-to {name} needs the {name} package"):
        main(["train", "--report-to", f"tensorboard,{name}", "--output-dir", str(out)])
    assert not out.exists()


def test_report_to_parses_a_comma_list():
    assert tracker_names("") == tracker_names("none") == ()
    assert tracker_names("tensorboard, WandB,mlflow,trackio,wandb") == ("tensorboard", "wandb", "mlflow", "trackio")
    with pytest.raises(ValueError, match=r"report_to='tensorboard,comet': unknown tracker 'comet'; give a comma list "
                                         r"of tensorboard, wandb, mlflow, trackio \(or none\)"):
        oomb.TrainConfig(report_to="tensorboard,comet", output_dir="x")
    with pytest.raises(ValueError, match=r"report_to='tensorboard': tensorboard writes its event files into "
                                         r"<output_dir>/tensorboard and no output_dir is given; add --output-dir DIR"):
        oomb.TrainConfig(report_to="tensorboard")
    with pytest.raises(SystemExit, match="unknown tracker 'comet'"):
        main(["train", "--report-to", "comet"])
    with pytest.raises(ValueError, match="Recorder is a class; pass an instance, Recorder()"):
        oomb.train(oomb.TrainConfig(**SMALL), callbacks=[Recorder])


def test_wandb_mlflow_and_trackio_get_the_rows_and_the_configuration(tmp_path, monkeypatch):
    """The three trackers not installed here, through stand-in modules that record their API calls
    (wandb.init / run.log / run.finish, mlflow.start_run / log_params / log_metrics / end_run,
    trackio.init / log / finish): each gets every row of metrics.jsonl at its step."""
    calls = []

    def module(name, **functions):
        mod = types.ModuleType(name)
        for fn in functions:
            setattr(mod, fn, (lambda fn: lambda *a, **k: calls.append((name, fn, a, k)) or functions[fn])(fn))
        monkeypatch.setitem(sys.modules, name, mod)

    run = types.SimpleNamespace(log=lambda values, step: calls.append(("wandb", "log", (values,), {"step": step})),
                                finish=lambda: calls.append(("wandb", "finish", (), {})))
    module("wandb", init=run)
    module("mlflow", start_run=object(), log_params=None, log_metrics=None, end_run=None)
    module("trackio", init=object(), log=None, finish=None)
    cfg = oomb.TrainConfig(**SMALL, steps=2, eval_every=2, output_dir=str(tmp_path / "run-a"),
                           report_to="wandb,mlflow,trackio")
    oomb.train(cfg)
    table = rows(tmp_path / "run-a")
    expected = [({k: float(v) for k, v in r.items() if k != "step"}, r["step"]) for r in table]
    for name, log in (("wandb", "log"), ("mlflow", "log_metrics"), ("trackio", "log")):
        mine = [c for c in calls if c[0] == name]
        assert mine[0][1] in ("init", "start_run") and mine[-1][1] in ("finish", "end_run"), mine
        assert [(c[2][0], c[3]["step"]) for c in mine if c[1] == log] == expected, name
    init = next(c for c in calls if c[:2] == ("wandb", "init"))
    assert init[3]["name"] == "run-a" and init[3]["config"]["report_to"] == "wandb,mlflow,trackio"
    params = next(c for c in calls if c[:2] == ("mlflow", "log_params"))[2][0]
    assert params["seq_len"] == 256 and params["rope_theta"] == ""


STOP_SCRIPT = """
import os, oomb

class Stop(oomb.Callback):
    def on_step_end(self, step, metrics):
        print(f"rank {os.environ['RANK']} on_step_end {step}", flush=True)
        return step == 2

losses = oomb.train(oomb.TrainConfig(seq_len=256, chunk_size=128, page_size=64, steps=5, backend="torch",
                                     output_dir=OUT, report_to="tensorboard"), callbacks=[Stop()])
print(f"rank {os.environ['RANK']} ran {len(losses)} steps", flush=True)
"""


def test_a_stop_under_torchrun_reaches_every_rank(tmp_path):
    """2 data-parallel ranks: the callbacks run on rank 0 only, and its stop ends both ranks after the
    same step (a rank that went on would wait forever at the next collective); one event file."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "stop.py"
    script.write_text(STOP_SCRIPT.replace("OUT", repr(str(tmp_path / "run"))))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert [line for line in lines if line.startswith("rank") and "on_step_end" in line] == \
        ["rank 0 on_step_end 1", "rank 0 on_step_end 2"]
    assert sorted(line for line in lines if " ran " in line) == ["rank 0 ran 2 steps", "rank 1 ran 2 steps"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", "config.yaml", "final", "metrics.jsonl", "step-000002",
                                                                   "tensorboard"]
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1
