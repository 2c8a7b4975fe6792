"""The trainer's checks outside its step: the model against this machine's memory before it is
built, the weights before they are written, and what a resume keeps of its checkpoint."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..parallel import local_tensor, local_world_size
from ..placement import human_bytes
from .config import TrainConfig
from .interrupt import TrainingStopped


def weight_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """cfg.dtype on `device` ('auto': bfloat16 on CUDA, float32 elsewhere)."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def float32_note(cfg: TrainConfig, device: torch.device) -> str:
    """The line a full-parameter run with fp32 weights on CUDA prints: its cost, and the setting
    that keeps fp32 weights at bf16 speed ('' otherwise)."""
    if device.type != "cuda" or weight_dtype(cfg, device) != torch.float32 or cfg.lora_rank:
        return ""
    return ("oomb train: note: float32 weights on CUDA run the projections as full fp32 GEMMs and the attention "
            "kernels at fp32 precision, without bf16 tensor cores: ~40x slower a step than bfloat16 (byte-lm-30m, "
            "16 x 4K, H200); --dtype bfloat16 --master-weights float32 keeps fp32 master weights and optimizer "
            "state and computes in bf16")


def check_model_fits(cfg: TrainConfig, device: torch.device, dp_size: int = 1) -> None:
    """Refuse, before the model is built, one whose weights, gradients and optimizer state (as the
    memory plan counts them: oomb.plan) exceed the memory `device` has free (CPU: the host's
    available memory, shared by this machine's processes). LoRA's adapters are left out."""
    from ..plan import plan
    from ..presets import load_config

    dtype = weight_dtype(cfg, device)
    zero = dp_size > 1 and cfg.tp == 1 and cfg.shard_optimizer
    p = plan(load_config(cfg.model, cfg.rope_theta, cfg.rope_scaling or None), seq_len=cfg.page_size,
             chunk_size=cfg.page_size, page_size=cfg.page_size, dtype=dtype, tp=cfg.tp,
             trainable_params=0 if cfg.lora_rank else None,
             optimizer_bytes_per_param=2 if cfg.optimizer == "adamw8bit" else None,
             optimizer_shards=dp_size if zero else 1,
             param_grad_dtype=torch.float32 if cfg.param_grad_dtype == "float32" else None,
             master_weights=cfg.master_weights != "none")
    need = p.weights + p.masters + p.grads + p.optimizer
    if device.type == "cuda":
        from ..memory.device import device_memory

        have = device_memory(device)[0]
    else:
        from ..memory.pinned import available_host_bytes

        have = available_host_bytes() // local_world_size()
    if need > have:
        what = "weights" if cfg.lora_rank else "weights, gradients and optimizer state"
        n = p.weights // dtype.itemsize
        raise ValueError(f"--model {cfg.model}: {n / 1e9:.2f}B parameters need {human_bytes(need)} for their {what} in "
                         f"{str(dtype).removeprefix('torch.')} on {device}, more than the {human_bytes(have)} free "
                         f"there; use a smaller model{'' if cfg.lora_rank else ', --lora-rank 16'}"
                         f"{', --dtype bfloat16' if dtype.itemsize == 4 else ''} or a machine with more memory")


def check_finite_weights(model: torch.nn.Module, step: int, losses: list[float], cfg: TrainConfig) -> None:
    """Refuse to write trainable weights that hold a NaN or an infinity (every rank calls this and
    they agree: one all-reduce). `losses`: this run's losses, the last one of step `step`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    finite = torch.stack([local_tensor(p.detach()).isfinite().all() for _, p in named]).to(torch.int32)
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    bad = [n for (n, _), ok in zip(named, finite.tolist()) if not ok]
    if not bad:
        return
    first = step - len(losses) + 1  # the step of losses[0]
    good = [first + i for i, loss in enumerate(losses) if math.isfinite(loss)]
    since = f"they went non-finite in the update of step {good[-1]}, the last with a finite loss" if good else \
        f"they were so at step {first - 1}, where this run started"
    raise TrainingStopped(f"not saving the weights of step {step}: {len(bad)} of {len(named)} trainable tensors hold "
                          f"NaN or infinity (e.g. {bad[0]}); {since}. Lower --lr (now {cfg.lr:g}) or --grad-clip, "
                          "and resume from an earlier checkpoint")


def resume_note(cfg: TrainConfig, optimizer: torch.optim.Optimizer, scheduler) -> str:
    """One line on what a resume keeps of its checkpoint where this run's flags differ (empty when
    nothing differs): the optimizer's peak lr and weight decay are the checkpoint's; the schedule's
    warm-up and decay follow this run's --steps and --warmup-steps from the resumed step on."""
    saved = json.loads((Path(cfg.resume) / "trainer.json").read_text()).get("config", {})
    kept = []
    lr, decay = float(scheduler.base_lrs[0]), float(optimizer.param_groups[0]["weight_decay"])
    if not math.isclose(lr, cfg.lr):
        kept.append(f"lr={lr:g} (--lr {cfg.lr:g} is not applied)")
    if not math.isclose(decay, cfg.weight_decay):
        kept.append(f"weight_decay={decay:g} (--weight-decay {cfg.weight_decay:g} is not applied)")
    changed = [f"--{k.replace('_', '-')} {getattr(cfg, k)} (was {saved[k]})" for k in ("steps", "warmup_steps", "lr_schedule")
               if k in saved and saved[k] != getattr(cfg, k)]
    if not kept and not changed:
        return ""
    parts = [f"keeps the checkpoint's {' and '.join(kept)}"] if kept else []
    if changed:
        parts.append(f"its schedule follows {', '.join(changed)} from here")
    return f"oomb train: --resume {cfg.resume} {'; '.join(parts)}"
