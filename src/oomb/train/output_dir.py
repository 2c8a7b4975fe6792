"""A run's output directory: one run at a time, a previous run's results never overwritten unasked.

Before any compute, rank 0:
- takes an exclusive lock (fcntl.flock on <output_dir>/.lock, held until the run ends): a second
  run into the same directory is refused while the first one lives;
- refuses a directory holding a previous run's files (metrics.jsonl, step-*, final, tensorboard) unless the
  run resumes (--resume) or replaces them (--overwrite: they are deleted first);
- removes what a killed run left half-written (durable.clean_stale);
- resolves --resume latest / auto to the newest verified checkpoint there.
Once the engine is built, rank 0 writes config.yaml: every setting as the run uses it
(write_resolved), which `oomb train --config` reads back.
Once the checkpoint is loaded, the trainer drops the rows of metrics.jsonl after the step it
resumes from (truncate_metrics: the resumed run writes them again), so that the file holds one
row per step.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from pathlib import Path

from . import checkpoint, durable
from .checks import weight_dtype
from .config import TrainConfig, config_yaml

PREVIOUS_RUN = ("metrics.jsonl", "final", "step-*", "tensorboard")  # tensorboard: --report-to's event files


class Lock:
    """An exclusive fcntl lock on <directory>/.lock: released by release() or when the process
    ends, however it ends (the kernel drops it with the file descriptor)."""

    def __init__(self, directory: Path) -> None:
        path = directory / ".lock"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ValueError(f"--output-dir {directory} is in use by another run (process {holder} holds {path}); "
                             "wait for it to end, or give another --output-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_output_dir(cfg, rank0: bool):
    """(cfg with --resume resolved to a checkpoint path or '', the Lock or None): every rank calls
    this; rank 0 checks, locks and prepares the directory, and the others take its answer (a
    refusal is a ValueError on every rank)."""
    lock, resume, error = None, cfg.resume, ""
    if rank0:
        try:
            lock, resume = _prepare(cfg)
        except ValueError as e:
            error = str(e)
    error, resume = checkpoint.from_rank0((error, resume))
    if error:
        raise ValueError(error)
    return dataclasses.replace(cfg, resume=resume), lock


def _prepare(cfg) -> tuple[Lock | None, str]:
    if not cfg.output_dir:
        _say_nothing_is_saved(cfg)
        if cfg.resume in ("latest", "auto"):
            raise ValueError(f"--resume {cfg.resume} takes the newest checkpoint in --output-dir, and none is given: "
                             "add --output-dir DIR")
        return None, cfg.resume
    if cfg.overwrite and cfg.resume:
        raise ValueError(f"--overwrite deletes {cfg.output_dir}'s previous run and --resume {cfg.resume} continues "
                         "one: give one of them")
    directory = Path(cfg.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    lock = Lock(directory)
    try:
        return lock, _claim(cfg, directory)
    except BaseException:
        lock.release()
        raise


def _claim(cfg, directory: Path) -> str:
    """Under the lock: the directory made this run's; returns the checkpoint to resume ('' none)."""
    cleaned = durable.clean_stale(directory)
    if cleaned:
        print(f"oomb train: removed what a killed run left in {directory}: {', '.join(sorted(cleaned))}", flush=True)
    previous = previous_run(directory)
    if previous and cfg.overwrite:
        for path in previous:
            if path.is_dir():
                durable.remove(path)
            else:
                path.unlink()
        print(f"oomb train: --overwrite: deleted the previous run's {', '.join(p.name for p in previous)} "
              f"in {directory}", flush=True)
    elif previous and not cfg.resume:
        raise ValueError(f"--output-dir {directory} holds a previous run ({', '.join(p.name for p in previous[:4])}"
                         f"{', ...' if len(previous) > 4 else ''}); continue it with --resume latest, or replace "
                         "it with --overwrite, or give another --output-dir")
    return _resolve_resume(cfg.resume, directory)


def previous_run(directory: Path) -> list[Path]:
    """The files a previous run left in `directory`."""
    return sorted(p for pattern in PREVIOUS_RUN for p in directory.glob(pattern))


def _resolve_resume(resume: str, directory: Path) -> str:
    """--resume latest / auto: the newest verified checkpoint in `directory` (auto: '' when there
    is none, latest: an error); a path: itself."""
    if resume not in ("latest", "auto"):
        return resume
    found = checkpoint.latest(directory)
    if found is None and resume == "latest":
        raise ValueError(f"--resume latest: {directory} holds no finished checkpoint (step-* with a manifest whose "
                         "files match it); start without --resume, or use --resume auto")
    print(f"oomb train: --resume {resume}: " + (f"{found}" if found else f"no checkpoint in {directory}, from step 0"),
          flush=True)
    return str(found) if found else ""


def truncate_metrics(path: str | Path, step: int) -> None:
    """Keep the rows of metrics.jsonl up to `step` (those of the run being resumed; 0: none),
    replacing the file whole; a half-written last row goes too."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    durable.write_file(path, "".join(line + "\n" for line in kept))


def _say_nothing_is_saved(cfg) -> None:
    """The first line of a run without --output-dir."""
    given = [f"--{name.replace('_', '-')} {value}" for name, value in
             (("save_every", cfg.save_every), ("save_total_limit", cfg.save_total_limit)) if value]
    if given:
        print(f"oomb train: warning: {' and '.join(given)} without --output-dir: nothing will be saved (no "
              "checkpoint, no metrics.jsonl, no final model); add --output-dir DIR", flush=True)
    else:
        print("oomb train: no --output-dir: nothing will be saved (no checkpoint, no metrics.jsonl, no final model)",
              flush=True)


def resolved_config(cfg: TrainConfig, engine, device) -> TrainConfig:
    """cfg as the run uses it: what oomb.auto chose (chunk_size, kv_grad_dtype, checkpoint_layers),
    compile, backend, dtype and device resolved, --resume the checkpoint it started from, so a
    --config of it runs the same step. overwrite is left false: deleting a directory's previous run
    is this invocation's act, not a setting to repeat. offload 'auto' and keep_attention unset stay
    so (the engine decides them at each step, from the memory free then), and so does pack unset
    (the data file decides it)."""
    e = engine.config
    return dataclasses.replace(cfg, chunk_size=e.chunk_size, kv_grad_dtype=str(e.kv_grad_dtype).removeprefix("torch."),
                               checkpoint_layers=e.checkpoint_layers, compile=e.compile_layers,
                               backend=engine.backend.name, dtype=str(weight_dtype(cfg, device)).removeprefix("torch."),
                               device=str(device), overwrite=False)


def write_resolved(cfg: TrainConfig, engine, device) -> None:
    """<output_dir>/config.yaml: resolved_config() in the format --config reads, replaced whole."""
    durable.write_file(Path(cfg.output_dir) / "config.yaml", config_yaml(resolved_config(cfg, engine, device)))
