"""Checkpoints that are whole or absent: written to a temporary directory, flushed, then renamed.

    <output_dir>/step-000040/
        model.safetensors   every parameter, with config.json: a transformers checkpoint
        (LoRA: adapter_model.safetensors, adapter_config.json and base.json: a PEFT adapter,
        named as PEFT names it, and the base it was trained on; oomb.train.export loads both)
        optimizer.pt        optimizer and scheduler state (optimizer-rank{r}.pt per rank under TP
                            and under ZeRO-1: each rank's share; resume with the same layout)
        master-weights.safetensors   with --master-weights float32: the fp32 masters the
                            optimizer steps (the weights above are them rounded to bf16)
        rng-rank{r}.pt      each rank's torch RNG states (CPU and CUDA): dropout repeats exactly
        trainer.json        step, batches the data stream has given, parallel layout, config
        manifest.json       every other file's size and SHA-256, written last: a resume checks them
    <output_dir>/final/     at the end: the trained model as transformers writes it
                            (AutoModelForCausalLM.from_pretrained), or the LoRA adapter as PEFT
                            does (PeftModel.from_pretrained on the base), plus the tokenizer

Nothing is unpickled: tensors are read with torch.load(weights_only=True) or safetensors, and
tensor-parallel (DTensor) optimizer state is saved as each rank's plain local tensors with their
placements in JSON, rebuilt with DTensor.from_local. A temporary directory has a unique name
(`step-000040.tmp-<pid>-<random>`); its files, itself and, after the rename, its parent are
fsynced; a directory it replaces is renamed aside first and removed last.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..parallel import is_dtensor
from . import durable
from .dtensor_state import local_state, with_dtensors
from .interrupt import TrainingStopped

#: what a failed write raises: the OS (a full disk, a rename), torch.save's writer, safetensors'
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


class SaveFailed(TrainingStopped):
    """A checkpoint or the final model could not be written; the run stops (the previous
    checkpoint is untouched: the message names it)."""


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole trainable tensors (tensor-parallel shards gathered: every rank must call this)."""
    return {n: _full(p.detach()).contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def is_adapter(model) -> bool:
    """A PEFT model: its checkpoints and exports hold the adapter, not the model."""
    return hasattr(model, "peft_config")


def weights_file(model) -> str:
    """The file of a checkpoint's trainable tensors: the names transformers and PEFT read."""
    return "adapter_model.safetensors" if is_adapter(model) else "model.safetensors"


def file_names(model) -> dict[str, str]:
    """{name in the weights file: parameter name} of the trainable parameters: PEFT's names
    (get_peft_model_state_dict drops the adapter's name, `.default`) for an adapter, else the
    parameters' own."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not is_adapter(model):
        return {n: n for n in params}
    from peft import get_peft_model_state_dict

    by_id = {id(p): n for n, p in params.items()}
    return {k: by_id[id(p)] for k, p in get_peft_model_state_dict(model, state_dict=params).items()}


def describing_files(model) -> dict:
    """The files beside the weights that make a checkpoint loadable by transformers / PEFT: the
    model's config.json, or the adapter's adapter_config.json (as PeftModel.save_pretrained
    writes it: inference mode, sets as lists) and base.json (oomb.train.export.Base)."""
    if not is_adapter(model):  # a whole transformers model (every parameter trained), or nothing to describe
        whole = hasattr(model, "config") and all(p.requires_grad for p in model.parameters())
        return {"config.json": model.config.to_json_string()} if whole else {}
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()}
    files = {"adapter_config.json": {**config, "inference_mode": True}}
    if getattr(model, "oomb_base", None) is not None:  # set by the trainer's build_model, or export.load
        files["base.json"] = json.dumps(dataclasses.asdict(model.oomb_base), indent=2)
    return files


def restore_trainable(model, state: dict[str, torch.Tensor], path: Path) -> None:
    """Copy a weights file's tensors into the model's trainable parameters (PEFT's names or, as
    an older oomb wrote them, the parameters' own); each tensor-parallel parameter takes its
    shard. ValueError naming a parameter the file lacks."""
    params = dict(model.named_parameters())
    lookup = {**{n: n for n in params}, **file_names(model)}
    found = {lookup[k] for k in state if k in lookup}
    missing = [n for n, p in params.items() if p.requires_grad and n not in found]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} trainable parameters, e.g. {missing[0]}; "
                         "was it written with the same model and LoRA settings?")
    with torch.no_grad():
        for key, tensor in state.items():
            if key not in lookup:
                continue
            p = params[lookup[key]]
            if is_dtensor(p):  # take this rank's shard of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                tensor = distribute_tensor(tensor.to(p.device), p.device_mesh, p.placements)
            p.copy_(tensor)


#: config fields a resume must share with the checkpoint (the data position, the parameter set, and
#: whether the optimizer's parameters are fp32 masters)
RESUME_FIELDS = ("model", "seq_len", "batch", "grad_accum", "lora_rank", "tp", "master_weights")

#: a checkpoint's fp32 master weights (oomb.train.master)
MASTERS_FILE = "master-weights.safetensors"


def step_dirs(output_dir: str | Path) -> list[Path]:
    """output_dir's step-N directories in step order (by number: step-1000000 after step-999999)."""
    root = Path(output_dir)
    found = [p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name[len("step-"):]))


def latest(output_dir: str | Path) -> Path | None:
    """The newest checkpoint in output_dir whose files match its manifest (a damaged or
    unfinished newer one is passed over, with a warning naming it). None: there is none."""
    for path in reversed(step_dirs(output_dir)):
        try:
            if not (path / "manifest.json").is_file():
                raise ValueError(f"checkpoint {path} has no manifest.json (it was never finished)")
            verify(path)
            return path
        except ValueError as e:
            warnings.warn(f"{e}; passed over for an earlier one", stacklevel=2)
    return None


def save(output_dir: str | Path, step: int, model, optimizer, scheduler, config, write: bool = True,
         masters=None) -> Path:
    """Every rank calls this (parameters are gathered); the rank with `write` writes the model
    (and, with `masters`, oomb.train.master.MasterWeights, their fp32 masters).

    Under tensor parallelism and ZeRO-1 each rank writes its own optimizer state
    (`optimizer-rank{r}.pt`): nothing is gathered (a 7B model's AdamW state is 30 GB in bf16).
    Free space is checked first (the tensors' bytes); a write that fails on any rank (a full
    disk, a file system error) raises SaveFailed on every rank, naming the last good checkpoint,
    and leaves the published ones as they were.
    """
    final = Path(output_dir) / f"step-{step:06d}"
    state = trainable_state(model)
    files = _rank_files(step, state, model, optimizer, scheduler, config, write)
    if write and masters is not None:
        files[MASTERS_FILE] = masters.state()
    tmp = final.with_name(from_rank0(durable.unique(final.name, "tmp")))
    need = int(_over_ranks(_nbytes(files) + 2**20, dist.ReduceOp.SUM))  # 1 MiB: JSON and file headers
    # Three phases, each ended by every rank agreeing it went well: the directory, each rank's
    # files, the manifest and the rename.
    for mine, action in ((write, lambda: _make_temp(tmp, need)), (True, lambda: _write_files(tmp, files)),
                         (write, lambda: _finish(tmp, final))):
        error = _attempt(action) if mine else ""
        if not _all_ok(error):
            if write:
                shutil.rmtree(tmp, ignore_errors=True)
            raise SaveFailed(f"the checkpoint of step {step} was not written ({error or 'another rank failed'}); "
                             f"{_last_good(output_dir) if write else 'rank 0 names the last good checkpoint'}")
    return final


def _rank_files(step: int, state: dict, model, optimizer, scheduler, config, write: bool) -> dict:
    """{file name: what goes in it} of this rank's share of a checkpoint."""
    per_rank = any(is_dtensor(p) for p in model.parameters()) or _is_zero(optimizer)
    files = {f"rng-rank{_rank()}.pt": _rng_state()}
    if per_rank or write:
        files[_optimizer_file(per_rank)] = _optimizer_payload(optimizer, scheduler)
    if write:
        names = {n: k for k, n in file_names(model).items()}
        files[weights_file(model)] = {names[n]: t for n, t in state.items()}
        files.update(describing_files(model))
        files["trainer.json"] = {"step": step, "batches_seen": step * config.grad_accum, "world_size": _world(),
                                 "config": dataclasses.asdict(config)}
    return files


def _write_files(tmp: Path, files: dict) -> None:
    """Each file written and flushed to the disk."""
    for name, content in files.items():
        path = tmp / name
        if name.endswith(".safetensors"):
            save_file(content, path)
        elif isinstance(content, str):
            path.write_text(content)
        elif name.endswith(".json"):
            path.write_text(json.dumps(content, indent=2))
        else:
            torch.save(content, path)
        durable.fsync(path)


def _make_temp(tmp: Path, need: int) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    durable.check_room(tmp.parent, need)
    tmp.mkdir()


def _finish(tmp: Path, final: Path) -> None:
    _write_manifest(tmp)
    durable.publish(tmp, final)


def _attempt(action) -> str:
    """'' when action() ran, else the write error it raised, in one line."""
    try:
        action()
    except WRITE_ERRORS as e:
        return (str(e).splitlines() or [type(e).__name__])[0]
    return ""


def _last_good(output_dir: str | Path) -> str:
    good = latest(output_dir)
    if good is None:
        return f"{output_dir} holds no earlier checkpoint; fix the cause (free space?) and start again"
    return f"the last good checkpoint is {good}: fix the cause (free space?) and resume with --resume {good}"


def prune(output_dir: str | Path, limit: int, newest: Path) -> list[Path]:
    """Delete the oldest step directories (by step number) beyond `limit`, once `newest` (the
    one just written) is verified; never `newest`. Returns the deleted ones; a failure to verify
    or to delete is a warning, and what is left stays."""
    older = [p for p in step_dirs(output_dir) if p != newest]
    doomed = older[: max(0, len(older) - (limit - 1))]
    try:
        if doomed:
            verify(newest)
        for path in doomed:
            durable.remove(path)
    except (ValueError, OSError) as e:
        warnings.warn(f"--save-total-limit {limit}: older checkpoints kept ({e})", stacklevel=2)
        return []
    return doomed


def _nbytes(obj) -> int:
    """Bytes of the tensors in a nested dict / list."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _write_manifest(path: Path) -> None:
    """Sizes and SHA-256 of every file of a written checkpoint, in manifest.json, written last."""
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(path.iterdir())
             if f.is_file() and f.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps({"files": files}, indent=1))
    durable.fsync(path / "manifest.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def verify(path: str | Path, names: set[str] | None = None) -> None:
    """Raise ValueError naming a missing, truncated or corrupted file of a checkpoint (checked
    against its manifest), before anything reads it. names: only those of the manifest's files
    (what one rank reads), default all."""
    path = Path(path)
    manifest = path / "manifest.json"
    if not manifest.is_file():
        warnings.warn(f"checkpoint {path} has no manifest.json (written by an older oomb): its files are not "
                      "checked", stacklevel=2)
        return
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        raise ValueError(f"checkpoint {path}: manifest.json is unreadable; the checkpoint is damaged, resume from "
                         "another one") from None
    for name, want in files.items():
        if names is not None and name not in names:
            continue
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {path} is incomplete: {name} is missing; resume from another checkpoint")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise ValueError(f"checkpoint {path}: {name} has {size:,} bytes, the manifest says {want['bytes']:,} "
                             "(truncated or overwritten); resume from another checkpoint")
        if _sha256(f) != want["sha256"]:
            raise ValueError(f"checkpoint {path}: {name} is corrupted (its SHA-256 differs from the manifest's); "
                             "resume from another checkpoint")


def check_compatible(path: Path, info: dict, config) -> None:
    """That this run can continue the checkpoint whose trainer.json is `info`: the same model,
    sequence length, batch layout, LoRA rank and parallel layout (ValueError naming each
    difference)."""
    saved = info.get("config", {})
    diffs = [f"{k}: {saved[k]!r} there, {getattr(config, k)!r} here" for k in RESUME_FIELDS
             if k in saved and saved[k] != getattr(config, k)]
    if info.get("world_size", _world()) != _world():
        diffs.append(f"processes: {info['world_size']} there, {_world()} here")
    if diffs:
        raise ValueError(f"--resume {path} was written by another run configuration ({'; '.join(diffs)}); "
                         "resume with the settings it was written with")


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _restore_rng(path: Path) -> None:
    file = path / f"rng-rank{_rank()}.pt"
    if not file.is_file():  # an older checkpoint: the run continues with this process's RNG
        return
    state = _load_tensors(file)
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export(output_dir: str | Path, model, source: str, write: bool = True) -> Path:
    """The trained model (or adapter) in transformers / PEFT format under <output_dir>/final.

    Every rank calls this: tensor-parallel shards are gathered one parameter at a time and
    only the writing rank keeps them (host memory: one model, on one rank). A failure to write
    raises SaveFailed on every rank; an earlier final/ stays until the new one is in place.
    """
    final = Path(output_dir) / "final"
    state = None
    if any(is_dtensor(p) for p in model.parameters()):
        state = {}
        for name, tensor in model.state_dict().items():
            whole = _full(tensor)
            if write:
                state[name] = whole.cpu()
    error = _attempt(lambda: write_export(model, state, source, final)) if write else ""
    if not _all_ok(error):
        raise SaveFailed(f"the final model was not written to {final} ({error or 'another rank failed'}); "
                         f"{_last_good(output_dir) if write else 'rank 0 names the last good checkpoint'}")
    return final


def write_export(model, state: dict | None, source: str, final: Path) -> None:
    """The model (or adapter) as transformers (PEFT) writes it, with `source`'s tokenizer, published
    in place of `final`."""
    tmp = final.with_name(durable.unique(final.name, "tmp"))
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # what save_pretrained writes: a PEFT model's adapters, else every tensor
        tensors = [p for p in model.parameters() if p.requires_grad] if hasattr(model, "peft_config") \
            else list(model.state_dict().values())
        durable.check_room(final.parent, _nbytes(tensors) + 2**20)
        model.save_pretrained(tmp, state_dict=state)  # None: transformers reads the parameters shard by shard
        if is_adapter(model) and "base.json" in (described := describing_files(model)):
            (tmp / "base.json").write_text(described["base.json"])
        _save_tokenizer(source, tmp)
        durable.fsync_tree(tmp)
        durable.publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # absent once published


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _save_tokenizer(source: str, path: Path) -> None:
    """The checkpoint's tokenizer beside the model (a preset has none; nor has a local directory
    without tokenizer files, where transformers would make an empty one from config.json)."""
    from ..presets import load_tokenizer

    if os.path.isdir(source) and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        return
    try:
        tokenizer = load_tokenizer(source)
    except ValueError:
        return
    tokenizer.save_pretrained(path)


def _optimizer_file(per_rank: bool) -> str:
    return f"optimizer-rank{_rank()}.pt" if per_rank else "optimizer.pt"


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    """ZeRO-1 shows one set of param_groups (the scheduler edits them) and steps a local
    optimizer that copies them at each step: keep the two alike around a checkpoint."""
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _is_zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def from_rank0(value):
    """Rank 0's `value` (a string, numbers) on every rank; `value` itself without torch.distributed."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _over_ranks(value: float, op) -> float:
    """`value` reduced over the ranks by `op` (one all-reduce); itself without torch.distributed."""
    if not dist.is_initialized():
        return value
    nccl = dist.get_backend() == "nccl"
    t = torch.tensor([value], dtype=torch.float64,
                     device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    dist.all_reduce(t, op=op)
    return float(t)


def _all_ok(error: str) -> bool:
    """Whether no rank has an error (every rank calls this at the same point)."""
    return _over_ranks(float(bool(error)), dist.ReduceOp.MAX) == 0


def _load_tensors(file: Path) -> dict:
    """torch.load of tensors, numbers, strings and containers only. A file holding any other
    object, which unpickling would construct by running code the file names, is refused."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        names = re.findall(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"a call to {names[0]}" if names else "objects other than tensors"
        raise ValueError(f"checkpoint {file.parent}: {file.name} holds {what}; oomb loads only tensors from a "
                         "checkpoint and runs no code from one: the file was not written by this oomb or was "
                         "altered: resume from a checkpoint you wrote") from None


def _optimizer_payload(optimizer, scheduler) -> dict:
    """What an optimizer file holds: tensors, numbers and strings only (read back by
    torch.load(weights_only=True)), each DTensor as its local tensor and its layout in JSON."""
    local = optimizer
    if _is_zero(optimizer):  # this rank's share, with the learning rate the scheduler set last
        local = optimizer.optim
        _copy_hyperparameters(optimizer.param_groups, local.param_groups)
    state, layouts = local_state(local.state_dict())
    return {"optimizer": state, "scheduler": scheduler.state_dict(), "ranks": _world(),
            "dtensors": json.dumps(layouts)}


def load(path: str | Path, model, optimizer, scheduler, config=None, masters=None) -> int:
    """Restore a checkpoint written by save() (its files checked against the manifest first, and
    with `config`, that this run can continue it); returns the step it was taken at. The RNG
    states are restored too: a resumed run computes what the uninterrupted one would have.
    masters: the run's MasterWeights, restored from the checkpoint's fp32 masters (and the
    weights from them)."""
    path = Path(path)
    if not (path / "trainer.json").is_file():
        raise ValueError(f"--resume {str(path)!r} is not a checkpoint directory (no trainer.json in it)")
    sharded = any(is_dtensor(p) for p in model.parameters())
    zero = _is_zero(optimizer)
    per_rank = sharded or zero
    weights = weights_file(model) if (path / weights_file(model)).is_file() else "model.safetensors"  # older oomb
    # This rank's files: under TP or ZeRO-1 each rank reads only its own optimizer share.
    verify(path, {"trainer.json", weights, _optimizer_file(per_rank), f"rng-rank{_rank()}.pt", MASTERS_FILE})
    info = json.loads((path / "trainer.json").read_text())
    if config is not None:
        check_compatible(path, info, config)
    restore_trainable(model, load_file(path / weights), path)
    if masters is not None:
        if not (path / MASTERS_FILE).is_file():
            raise ValueError(f"checkpoint {path} has no {MASTERS_FILE}: it was written without --master-weights "
                             "float32; resume with the settings it was written with")
        masters.load(load_file(path / MASTERS_FILE), path)
    file = path / _optimizer_file(per_rank)
    if not file.is_file():
        raise ValueError(f"checkpoint {path} has no {file.name}: it was written with another parallel layout; "
                         "resume with the --tp, process count and --shard-optimizer setting it was written with")
    opt = _load_tensors(file)
    if per_rank and opt.get("ranks") != _world():
        raise ValueError(f"checkpoint {path} holds the optimizer shards of {opt.get('ranks')} ranks, this run has "
                         f"{_world()}: resume with the number of processes it was written with")
    local = optimizer.optim if zero else optimizer  # ZeRO-1: this rank's share
    local.load_state_dict(with_dtensors(opt["optimizer"], json.loads(opt.get("dtensors", "{}")), local, file))
    if zero:  # the hyperparameters (lr) the wrapper shows
        _copy_hyperparameters(optimizer.optim.param_groups, optimizer.param_groups)
    scheduler.load_state_dict(opt["scheduler"])
    _restore_rng(path)
    return info["step"]
