"""The training loop: the engine computes gradients, this owns data, optimizer and state."""
from __future__ import annotations

import math
import time

import torch

from ..engine import ChunkRecurrentEngine
from ..presets import load_model
from . import checkpoint
from .config import TrainConfig
from .data import make_data
from .metrics import StepLogger

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use --device cpu")
    return device


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    model = load_model(cfg.model, dtype=dtype, device=device)
    model.train()
    if cfg.lora_rank:
        import peft

        lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                               target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, lora)
    return model


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def train(cfg: TrainConfig) -> list[float]:
    """Run cfg.steps optimizer steps; returns the loss of every step."""
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = build_model(cfg, device)
    engine = ChunkRecurrentEngine(model, chunk_size=cfg.chunk_size, page_size=cfg.page_size, backend=cfg.backend,
                                  offload=cfg.offload, kv_grad_dtype=getattr(torch, cfg.kv_grad_dtype))
    engine.reserve(cfg.batch, cfg.seq_len)  # pages (and pinned host memory) once, checked before step 1
    vocab = engine.adapter.vocab_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    step = checkpoint.load(cfg.resume, model, optimizer, scheduler) if cfg.resume else 0
    data = make_data(cfg.data, vocab, cfg.seq_len, cfg.batch, seed=cfg.seed + step)

    n_params = sum(p.numel() for p in params)
    print(f"oomb train: {cfg.model} ({n_params / 1e6:.2f}M trainable params) on {device}, "
          f"backend {engine.backend}, offload {cfg.offload}, {cfg.batch} x {cfg.seq_len:,} tokens a step, "
          f"chunk {cfg.chunk_size}, page {cfg.page_size}, {cfg.steps} steps", flush=True)
    logger = StepLogger(cfg.steps, device)
    losses = []
    while step < cfg.steps:
        input_ids, labels = next(data)
        if int(input_ids.max()) >= vocab:
            raise ValueError(f"token id {int(input_ids.max())} in the data is >= the model's vocab_size={vocab}; "
                             "the data was tokenised for another model")
        t0 = time.perf_counter()
        result = engine.forward_backward(input_ids, labels)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step += 1
        loss = float(result.loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr (now {cfg.lr}) or check the data")
        losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.steps:
            logger.log(step, loss, input_ids.numel(), time.perf_counter() - t0, scheduler.get_last_lr()[0], grad_norm)
        if cfg.output_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
            path = checkpoint.save(cfg.output_dir, step, model, optimizer, scheduler, cfg)
            print(f"saved {path}", flush=True)
    return losses
