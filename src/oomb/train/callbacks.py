"""Callbacks of `oomb.train(config, callbacks=[...])`, and the experiment trackers of --report-to
built on them (one mechanism: a tracker is a callback that sends what it is given).

A callback is any object with some of these methods (oomb.Callback has them all, doing nothing):

    on_train_begin(step, config)  before the first step: the step the run starts from (a resumed
                                  run's), the run's configuration as a dict (output_dir.resolved_config)
    on_step_end(step, metrics)    after each logged step (every step at --log-every 1): the row
                                  metrics.jsonl gets for it
    on_evaluate(step, results)    after each evaluation (--eval-every): its metrics.jsonl row
    on_save(step, path)           after each checkpoint is written: its directory
    on_train_end()                when the run ends, however it ends (also on an error)

A step, evaluation or save hook that returns True asks the run to stop: the run ends after this
step as a run whose last step it was (evaluated, checkpointed and exported as its settings say).
Under torch.distributed the callbacks run on rank 0, the rank that logs and writes, and its answer
is broadcast to the others.
"""
from __future__ import annotations

import importlib
import json
import os

import torch
import torch.distributed as dist

HOOKS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


class Callback:
    """The hooks the trainer calls (see the module's docstring); subclass and override some."""

    def on_train_begin(self, step: int, config: dict) -> None:
        return None

    def on_step_end(self, step: int, metrics: dict) -> bool | None:
        return None

    def on_evaluate(self, step: int, results: dict) -> bool | None:
        return None

    def on_save(self, step: int, path: str) -> bool | None:
        return None

    def on_train_end(self) -> None:
        return None


class CallbackList:
    """A run's callbacks, called in order (the caller's, then the trackers'); `stop`: one of them
    asked the run to stop."""

    def __init__(self, callbacks=()) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if isinstance(cb, type):
                raise ValueError(f"callbacks: {cb.__name__} is a class; pass an instance, {cb.__name__}()")
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise ValueError(f"callbacks: {cb!r} has none of the hooks {', '.join(HOOKS)}; subclass "
                                 "oomb.Callback and override those it needs")
        self.stop = False

    def _call(self, hook: str, step: int, *args) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None and method(step, *args) and hook != "on_train_begin":
                if not self.stop:
                    print(f"oomb train: {type(cb).__name__}.{hook} asked the run to stop: step {step} is its last",
                          flush=True)
                self.stop = True

    def begin(self, step: int, config: dict) -> None:
        self._call("on_train_begin", step, config)

    def step_end(self, step: int, metrics: dict) -> None:
        self._call("on_step_end", step, metrics)

    def evaluate(self, step: int, results: dict) -> None:
        self._call("on_evaluate", step, results)

    def save(self, step: int, path: str) -> None:
        self._call("on_save", step, path)

    def end(self) -> None:
        """on_train_end of every callback, each even when an earlier one fails (the first error is raised)."""
        error = None
        for cb in self.callbacks:
            try:
                if getattr(cb, "on_train_end", None) is not None:
                    cb.on_train_end()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others have closed
                error = error or e
        if error is not None:
            raise error

    def agreed(self, group=None) -> bool:
        """Whether to stop after this point: `stop`, and under torch.distributed rank 0's (where the
        callbacks run), broadcast over `group` (the host group of the stop flag); every rank calls
        it at the same points."""
        if dist.is_initialized():
            flag = torch.tensor([int(self.stop)], dtype=torch.int32)
            dist.broadcast(flag, src=0, group=group)
            self.stop = bool(flag.item())
        return self.stop


# -- trackers (--report-to) ------------------------------------------------------------------------

def tracker_names(report_to: str) -> tuple[str, ...]:
    """--report-to's comma list ('', 'none': no tracker), each name checked."""
    names = [n.strip().lower() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return ()
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to={report_to!r}: unknown tracker {unknown[0]!r}; give a comma list of "
                         f"{', '.join(TRACKERS)} (or none)")
    return tuple(dict.fromkeys(names))


def trackers(cfg) -> list[Callback]:
    """cfg.report_to's trackers, their packages imported: a missing one is an error naming the pip
    command, raised before any compute (train() calls this first)."""
    return [TRACKERS[name](cfg) for name in tracker_names(cfg.report_to)]


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--report-to {package} needs the {package} package, which is not installed here ({e}); "
                         f"pip install 'oomb[{package}]' (or pip install {package}), or drop {package} from "
                         "--report-to") from None


def scalars(row: dict) -> dict[str, float]:
    """A metrics.jsonl row as a tracker's scalars ('step' is their x axis): numbers (True as 1),
    the skipped steps' 'nan' / 'inf' strings as floats, a dict as one scalar per entry
    (eval_recall/0-4K)."""
    out = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()})
        elif isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, str):
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def run_name(cfg) -> str | None:
    """The trackers' run name: the output directory's name (None: the tracker's own default)."""
    return os.path.basename(os.path.normpath(cfg.output_dir)) if cfg.output_dir else None


class Tracker(Callback):
    """Sends every step's and evaluation's row to log(step, scalars)."""

    def on_step_end(self, step: int, metrics: dict) -> None:
        self.log(step, scalars(metrics))

    def on_evaluate(self, step: int, results: dict) -> None:
        self.log(step, scalars(results))

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    """Event files in <output-dir>/tensorboard: a scalar per metric, the configuration as text."""

    def __init__(self, cfg) -> None:
        self.SummaryWriter = _require("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.log_dir = os.path.join(cfg.output_dir, "tensorboard")
        self.writer = None

    def on_train_begin(self, step: int, config: dict) -> None:
        # a resumed run hides the events after its step (TensorBoard's purge_step), as metrics.jsonl drops those rows
        self.writer = self.SummaryWriter(self.log_dir, purge_step=step + 1 if step else None)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def on_train_end(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Tracker):
    """A Weights & Biases run in project $WANDB_PROJECT (default oomb); WANDB_MODE=offline keeps it local."""

    def __init__(self, cfg) -> None:
        self.wandb = _require("wandb", "wandb")
        self.name, self.dir, self.run = run_name(cfg), cfg.output_dir or None, None

    def on_train_begin(self, step: int, config: dict) -> None:
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "oomb"), name=self.name, dir=self.dir,
                                   config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def on_train_end(self) -> None:
        if self.run is not None:
            self.run.finish()


class MLflow(Tracker):
    """An MLflow run (the configuration as its parameters); MLflow's own settings
    (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME) say where it goes."""

    def __init__(self, cfg) -> None:
        self.mlflow = _require("mlflow", "mlflow")
        self.name, self.run = run_name(cfg), None

    def on_train_begin(self, step: int, config: dict) -> None:
        self.run = self.mlflow.start_run(run_name=self.name)
        self.mlflow.log_params({k: "" if v is None else v for k, v in config.items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def on_train_end(self) -> None:
        if self.run is not None:
            self.mlflow.end_run()


class Trackio(Tracker):
    """A Trackio run in project oomb (local unless $TRACKIO_SPACE_ID names a Space)."""

    def __init__(self, cfg) -> None:
        self.trackio = _require("trackio", "trackio")
        self.name, self.run = run_name(cfg), None

    def on_train_begin(self, step: int, config: dict) -> None:
        self.run = self.trackio.init(project="oomb", name=self.name, config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def on_train_end(self) -> None:
        if self.run is not None:
            self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}
