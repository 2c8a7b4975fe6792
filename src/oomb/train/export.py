"""What a run writes, read back: `oomb eval`, `oomb plan` and `oomb export` take any of it.

A model directory is one of
- a transformers checkpoint (config.json): a full-parameter run's final/ and step-N;
- a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors): a LoRA run's final/ and
  step-N; its base is in base.json (oomb writes it) or adapter_config.json's base_model_name_or_path;
- an older oomb's step-N (trainer.json, model.safetensors named as the parameters are): its base
  and LoRA settings are in trainer.json.

An adapter's base (Base) is recorded so that it resolves from anywhere: a local checkpoint by its
absolute path, a preset name or hub id as given. A preset's weights are random: an adapter over
one is loaded on the preset's weights drawn again with the run's seed on its kind of device in its
dtype, checked against the fingerprint taken at training (another seed, device kind or library
version draws other weights: such an adapter is refused, not evaluated on the wrong base).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from . import checkpoint

FINGERPRINT_ELEMENTS = 4096  # of each tensor: another seed or device changes every one of them
KINDS = ("config.json (a transformers checkpoint: a full-parameter run's final/ or step-N), adapter_config.json "
         "(a LoRA run's final/ or step-N) or trainer.json (an older oomb's step-N)")


@dataclasses.dataclass(frozen=True)
class Base:
    """The model an adapter was trained on (base.json)."""
    model: str  # a local checkpoint's absolute path, a preset name or a hub id
    rope_theta: float | None = None  # the run's RoPE extension (models/rope.py), applied again when eval gives none
    rope_scaling: str = ""
    # a preset's random weights: torch.manual_seed(seed), drawn on `device` ('cpu' or 'cuda') in `dtype`
    seed: int | None = None
    device: str | None = None
    dtype: str | None = None
    fingerprint: str | None = None


def base_of(cfg, model: torch.nn.Module) -> Base:
    """The Base of a run of `cfg` whose base `model` was just built (before LoRA and TP)."""
    from ..presets import PRESETS

    name = os.path.abspath(cfg.model) if cfg.model not in PRESETS and os.path.isdir(cfg.model) else cfg.model
    base = Base(name, cfg.rope_theta, cfg.rope_scaling)
    if cfg.model not in PRESETS:
        return base
    p = next(model.parameters())
    return dataclasses.replace(base, seed=cfg.seed, device=p.device.type, dtype=str(p.dtype).removeprefix("torch."),
                               fingerprint=fingerprint(model))


def fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's name, shape, dtype and first FINGERPRINT_ELEMENTS values."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name} {tuple(p.shape)} {p.dtype}".encode())
        h.update(p.detach().reshape(-1)[:FINGERPRINT_ELEMENTS].float().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Artefact:
    """A model directory: what it is and what loading it reads."""
    path: Path
    base: Base | None = None  # None: a transformers checkpoint (from_pretrained loads it whole)
    weights: str = ""  # the file of the trained tensors laid over the base
    lora: object = None  # the adapter's peft.LoraConfig; None: the tensors are the model's own

    def verify(self) -> None:
        """The files loading reads, against the manifest of a step-N (a final/ has none)."""
        if (self.path / "manifest.json").is_file():
            checkpoint.verify(self.path, {f.name for f in self.path.iterdir() if f.suffix != ".pt"})


def describe(name_or_path: str) -> Artefact | None:
    """What the directory holds (None: not a directory: a preset or a hub id); ValueError for a
    directory that is no model."""
    path = Path(name_or_path)
    if not path.is_dir():
        return None
    if (path / "config.json").is_file():
        return Artefact(path)
    if (path / "adapter_config.json").is_file():
        return _adapter(path)
    if (path / "trainer.json").is_file():
        return _older_step(path)
    run = "; it is a run's output directory: give its final/ or one of its step-N" \
        if (path / "final").is_dir() or checkpoint.step_dirs(path) else ""
    raise ValueError(f"--model {name_or_path!r} is a directory with no model in it: it has no {KINDS}{run}")


def _adapter(path: Path) -> Artefact:
    import peft

    config = peft.PeftConfig.from_pretrained(path)
    if config.peft_type != peft.PeftType.LORA:
        raise ValueError(f"{path} holds a {config.peft_type.value} adapter; oomb loads LoRA adapters")
    if not (path / "adapter_model.safetensors").is_file():
        raise ValueError(f"{path} has adapter_config.json but no adapter_model.safetensors (oomb reads tensors from "
                         "safetensors only, never a pickled .bin)")
    if (path / "base.json").is_file():
        base = Base(**json.loads((path / "base.json").read_text()))
    elif config.base_model_name_or_path:
        base = Base(config.base_model_name_or_path)
    else:
        raise ValueError(f"{path}: the adapter does not say which model it was trained on (no base.json, and "
                         "adapter_config.json's base_model_name_or_path is null: an older oomb's adapter over a "
                         "preset); export the run's last step-N again: oomb export RUN/step-N --output DIR")
    config.inference_mode = False  # its tensors are the PeftModel's trainable ones: restore_trainable fills them
    return Artefact(path, base, "adapter_model.safetensors", config)


def _older_step(path: Path) -> Artefact:
    """A step-N an older oomb wrote: trainer.json says what it was trained on."""
    from ..models.base import DecoderAdapter
    from ..presets import PRESETS

    run = json.loads((path / "trainer.json").read_text()).get("config", {})
    base = Base(run.get("model", "tiny"), run.get("rope_theta"), run.get("rope_scaling", ""))
    lora = None
    if run.get("lora_rank"):
        import peft

        # an older oomb put adapters on the same projections in every family: the base adapter's
        lora = peft.LoraConfig(r=run["lora_rank"], lora_alpha=run.get("lora_alpha", 16.0), lora_dropout=0.0,
                               target_modules=list(DecoderAdapter.lora_targets))
        if base.model in PRESETS and run.get("device") in ("cpu", "cuda"):  # "auto": where it ran is unknown
            dtype = run.get("dtype", "auto")
            dtype = dtype if dtype != "auto" else "bfloat16" if run["device"] == "cuda" else "float32"
            base = dataclasses.replace(base, seed=run.get("seed", 0), device=run["device"], dtype=dtype)
    return Artefact(path, base, "model.safetensors", lora)


def load(artefact: Artefact, dtype: torch.dtype | None, device, rope_theta: float | None = None,
         rope_scaling: str | None = None, merge: bool = True) -> torch.nn.Module:
    """The model of a directory with a base (an adapter, an older step): the base, the trained
    tensors laid over it, the adapter merged into it (merge) or as a PeftModel. dtype None: the
    base's own (a preset's: the run's)."""
    from safetensors.torch import load_file

    artefact.verify()
    base = artefact.base
    rope_theta = base.rope_theta if rope_theta is None else rope_theta
    rope_scaling = rope_scaling or base.rope_scaling or None
    state = load_file(artefact.path / artefact.weights)
    if dtype is None and artefact.lora is None:  # an older full step: every weight is in the file
        dtype = next(iter(state.values())).dtype
    model = _base_model(base, dtype, device, rope_theta, rope_scaling, drawn=artefact.lora is not None)
    if artefact.lora is not None:
        import peft

        with warnings.catch_warnings():  # peft asks transformers 5's deprecated name, once per model
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            lora = copy.deepcopy(artefact.lora)
            lora.base_model_name_or_path = None  # get_peft_model sets it (and warns when it was another)
            model = peft.get_peft_model(model, lora)
        model.peft_config["default"].base_model_name_or_path = base.model
        model.oomb_base = base  # written again beside the adapter by an export (checkpoint.describing_files)
    checkpoint.restore_trainable(model, state, artefact.path)
    if artefact.lora is not None and merge:  # a plain transformers model, trainable as load_model's are
        model = model.merge_and_unload().requires_grad_(True)
    model.config.use_cache = False
    return model


def _base_model(base: Base, dtype, device, rope_theta, rope_scaling, drawn: bool) -> torch.nn.Module:
    """The base model; a preset's random weights drawn again as the run drew them (`drawn`:
    they matter, an adapter sits on them) and checked against its fingerprint."""
    from ..presets import PRESETS, load_model

    if base.model not in PRESETS or not drawn:
        return load_model(base.model, dtype or "auto", device, rope_theta, rope_scaling)
    what = f"the preset {base.model!r}'s random weights"
    if base.seed is None or base.device is None:
        raise ValueError(f"the adapter's base is {what}, and where they were drawn is not recorded (trained with "
                         "--device auto by an older oomb): they cannot be drawn again; train again, or on a checkpoint")
    if base.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the adapter's base is {what}, drawn on a CUDA device with seed {base.seed}: they can be "
                         "drawn again only on one (CUDA and the CPU draw other numbers); run this where CUDA is")
    draw_on = torch.device("cuda", torch.cuda.current_device()) if base.device == "cuda" else torch.device("cpu")
    with torch.random.fork_rng(devices=[draw_on.index] if draw_on.type == "cuda" else []):
        torch.manual_seed(base.seed)
        model = load_model(base.model, getattr(torch, base.dtype), draw_on, rope_theta, rope_scaling)
    if base.fingerprint is not None and fingerprint(model) != base.fingerprint:
        raise ValueError(f"the adapter's base is {what} (seed {base.seed}, {base.device}, {base.dtype}), and drawing "
                         "them again here gives other weights (another torch or transformers version, or another "
                         "kind of GPU): the adapter cannot be evaluated on them. Evaluate where it was trained, or "
                         "train on a checkpoint")
    return model.to(device=device, dtype=dtype or model.dtype)


def export(source: str, output: str, merge: bool = False, overwrite: bool = False) -> Path:
    """`oomb export`: a run's step-N or final/ as its final/ is (a transformers checkpoint, or the
    LoRA adapter with base.json), or with `merge` the adapter merged into its base: one
    transformers checkpoint in the base's dtype; with the tokenizer (and chat template) of the
    source or its base. Written beside `output` and renamed into place (durable.publish)."""
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--output {out} is not empty; give --overwrite to replace it, or another --output")
    src = Path(source).resolve()
    if src == out.resolve() or out.resolve() in src.parents:
        raise ValueError(f"--output {out} holds the checkpoint {source} being exported; give another --output")
    artefact = describe(source)
    if artefact is None:
        raise ValueError(f"{source!r} is not a directory; give a run's step-N or final/ (a directory with {KINDS})")
    if artefact.base is None:
        from transformers import AutoModelForCausalLM

        artefact.verify()
        model = AutoModelForCausalLM.from_pretrained(artefact.path, dtype="auto")
    else:
        model = load(artefact, None, "cpu", merge=merge)
    has_tokenizer = any((artefact.path / name).is_file() for name in checkpoint.TOKENIZER_FILES)
    tokenizer = artefact.path if has_tokenizer or artefact.base is None else artefact.base.model
    checkpoint.write_export(model, None, str(tokenizer), out)
    return out
