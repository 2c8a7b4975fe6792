"""What an `oomb eval --task` is: one EvalTask, declared in its own file of oomb.eval and registered
once (oomb/eval/__init__.py). The command builds `--task`'s choices and every task's flags from the
registry and calls the chosen task's `run` on an engine it built from the shared flags; nothing
about a task is written anywhere else."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..engine import ChunkRecurrentEngine

Progress = Callable[[int, int], None]  # progress(done, total) after each chunk pass (ChunkRecurrentEngine)


def seq_len_of(args: argparse.Namespace) -> int:
    return args.seq_len


@dataclass(frozen=True)
class EvalTask:
    """One evaluation task.

    run(args, engine, progress) evaluates it on an engine over the model (no dK/dV pages) and
    returns a JSON-ready dict with "task" = name (the command adds "model", "data" and
    "attention"; a "samples" entry is kept out of --json). report(result) is its text: the first
    line follows "TASK: MODEL on DATA, ATTENTION attention: ", the others stand below it.
    plot(result, label, path) writes a PNG (None: the task draws none, and --plot is refused
    before anything is evaluated)."""

    name: str
    help: str  # what it measures, a phrase: --task's help lists them
    run: Callable[[argparse.Namespace, ChunkRecurrentEngine, Progress | None], dict]
    report: Callable[[dict], list[str]]
    # TrainConfig fields it reads beyond the shared ones: flags from their declarations (oomb.flags),
    # each with add_argument keywords that replace the declared ones here ({}: as declared; say why)
    settings: Mapping[str, dict] = field(default_factory=dict)
    flags: Mapping[str, dict] = field(default_factory=dict)  # its own: {"--name": add_argument keywords}
    plot: Callable[[dict, str, str], None] | None = None
    longest: Callable[[argparse.Namespace], int] = seq_len_of  # the longest sequence: the RoPE positions checked


TASKS: dict[str, EvalTask] = {}


def register(task: EvalTask) -> EvalTask:
    """Adds `task` to `oomb eval --task`. A flag or setting two tasks declare must be declared the
    same (one object, e.g. oomb.eval.inputs.BATCHES), since it is one flag of the command."""
    if task.name in TASKS and TASKS[task.name] is not task:
        raise ValueError(f"an eval task named {task.name!r} is registered already; choose another name")
    for kind in ("settings", "flags"):
        for other in TASKS.values():
            for name in getattr(task, kind).keys() & getattr(other, kind).keys():
                if getattr(task, kind)[name] != getattr(other, kind)[name]:
                    raise ValueError(f"eval task {task.name!r} declares {name} otherwise than {other.name!r}; "
                                     "declare it once and use that in both")
    TASKS[task.name] = task
    return task


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """Every registered task's settings (from TrainConfig's declarations) and own flags, once each;
    an own flag's help starts with the tasks that read it."""
    from ..flags import add_settings

    settings: dict[str, dict] = {}
    flags: dict[str, tuple[dict, list[str]]] = {}
    for task in TASKS.values():
        settings.update(task.settings)
        for name, keywords in task.flags.items():
            flags.setdefault(name, (keywords, []))[1].append(task.name)
    add_settings(parser, tuple(settings), settings)
    for name, (keywords, users) in flags.items():
        parser.add_argument(name, **{**keywords, "help": f"{', '.join(users)}: {keywords['help']}"})
