"""The training loop: the engine computes gradients, this owns data, optimizer and state.
train() is set_up() (a Run: model, optimizer, engine, data), then train_loop(), a train_step() at a time."""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..attention.policy import build_policy
from ..auto import Choice, Machine, NothingFits, choose, compiles
from ..config import EngineConfig, KernelOptions
from ..data.codec import codec_for
from ..data.documents import data_layout
from ..data.recall import RecallMix, RecallTask, Tally, answers, bucket_of, default_edges, queries
from ..data.tokens import copy_entropy, copy_halves, load_tokens, windows
from ..engine import ChunkRecurrentEngine
from ..memory.schedule import HOST_LEAD_CHUNKS
from ..models import adapter_class
from ..models.float8 import apply_float8
from ..models.liger import apply_liger
from ..parallel import (all_reduce_gradients, apply_tensor_parallel, clip_grad_norm_, global_token_count,
                        host_group, init_distributed, local_tensor, local_world_size, world_size)
from ..models.rope import check_positions
from ..presets import load_model
from . import checkpoint
from .callbacks import CallbackList, trackers
from .checks import check_finite_weights, check_model_fits, float32_note, resume_note, weight_dtype
from .config import TrainConfig
from .data import NeedleMix, make_data
from .export import base_of
from .interrupt import Interrupt, StepAbandoned, TrainingStopped
from .master import MasterWeights, refusal
from .metrics import StepLogger, chunk_progress, memory_now
from .output_dir import open_output_dir, resolved_config, truncate_metrics, write_resolved


def resolve_device(name: str) -> torch.device:
    """The device of --device: 'auto' is CUDA when there is one; a CUDA device gets its index
    ('cuda' is the current device, as torch reads it)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def build_model(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    model = load_model(cfg.model, dtype=weight_dtype(cfg, device), device=device, rope_theta=cfg.rope_theta,
                       rope_scaling=cfg.rope_scaling or None)
    check_positions(model.config, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
    base = base_of(cfg, model) if cfg.lora_rank else None  # what the adapter's checkpoints name as its base
    model.train()
    if cfg.liger:
        apply_liger(model)  # before LoRA wraps the projections: Liger patches the norm and MLP modules
    if cfg.lora_rank:
        import peft

        lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                               target_modules=list(adapter_class(model.config).lora_targets))
        with warnings.catch_warnings():  # peft asks transformers 5's deprecated name, once per model
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = peft.get_peft_model(model, lora)
        model.peft_config["default"].base_model_name_or_path = base.model
        model.oomb_base = base
    if cfg.float8 != "none":
        apply_float8(model, cfg.float8)  # after LoRA: a wrapped projection's base layer, not its adapters
    return model


def engine_config(cfg, kernels: KernelOptions | None = None, **extra) -> EngineConfig:
    """The EngineConfig of a TrainConfig's engine settings (`extra`: what the run measures or
    decides, reserved_gpu_bytes, local_world_size, compile_layers). The fields left to 'auto'
    (cfg.auto_fields) take EngineConfig's defaults here: oomb.auto.choose() sets them."""
    given = {"chunk_size": cfg.chunk_size, "kv_grad_dtype": getattr(torch, cfg.kv_grad_dtype, None),
             "checkpoint_layers": cfg.checkpoint_layers}
    extra = {"compile_layers": cfg.compile_layers, **extra}
    return EngineConfig(**{k: v for k, v in given.items() if k not in cfg.auto_fields},
                        page_size=cfg.page_size, group_pages=cfg.group_pages,
                        backend=cfg.backend, offload=cfg.offload, sparse=build_policy(cfg),
                        param_grad_dtype=torch.float32 if cfg.param_grad_dtype == "float32" else None,
                        keep_attention=cfg.keep_attention,
                        kept_host_bytes=None if cfg.kept_host_gib is None else int(cfg.kept_host_gib * 2**30),
                        kernels=kernels or KernelOptions(), **extra)


def plan_args(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg) -> dict:
    """What oomb.plan.plan() needs of this run beside the engine's settings: this rank's
    parameter counts, the optimizer state per trainable parameter (of the fp32 masters with
    master_weights), the weights' dtype, TP, and whether fp32 masters are kept."""
    params = list(model.parameters())
    trainable = sum(local_tensor(p).numel() for p in params if p.requires_grad)
    return dict(n_params=sum(local_tensor(p).numel() for p in params), trainable_params=trainable,
                optimizer_bytes_per_param=-(-optimizer_state_bytes(optimizer) // max(1, trainable)),
                dtype=params[0].dtype, tp=cfg.tp, master_weights=cfg.master_weights != "none")


def run_engine_config(cfg, model, device: torch.device, optimizer, kernels: KernelOptions | None = None
                      ) -> tuple[EngineConfig, Choice | None]:
    """The engine settings of a run of `cfg`: compile 'auto' resolved (oomb.auto.compiles), room
    left for the optimizer's state, and the fields left to 'auto' chosen (oomb.auto.choose, with
    the Choice; None when every field was given). bench/bench_step.py's oomb-default calls it too."""
    compile_layers = cfg.compile_layers or (cfg.compile is None and compiles(model.config, device, bool(cfg.lora_rank)))
    base = engine_config(cfg, kernels, reserved_gpu_bytes=optimizer_state_bytes(optimizer),
                         local_world_size=local_world_size(), compile_layers=compile_layers)
    if not cfg.auto_fields:
        return base, None
    choice = choose_engine(cfg, model, device, base, optimizer)
    return choice.engine, choice


def choose_engine(cfg, model, device, base: EngineConfig, optimizer, below: Choice | None = None) -> Choice:
    """oomb.auto.choose() for this run: the free fields of cfg over `base`, on the memory this
    machine has now (shared among the local processes)."""
    machine = Machine.measure(device, local_world_size()) if below is None else below.machine
    return choose(model.config, cfg.seq_len, machine, base, cfg.auto_fields, batch=cfg.batch, below=below,
                  **plan_args(model, optimizer, cfg))


def replan_after_oom(cfg, model, device, choice: Choice, optimizer, error: str) -> Choice:
    """After the first step ran out of GPU memory: free what it held, and the next setting that
    needs less working memory (an error naming both when there is none)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        smaller = choose_engine(cfg, model, device, choice.engine, optimizer, below=choice)
    except NothingFits as e:
        raise NothingFits(f"step 1 ran out of GPU memory ({error}) and {e}") from None
    print(f"oomb train: step 1 ran out of GPU memory with {choice.settings()}; retrying with "
          f"{smaller.settings()}", flush=True)
    return smaller


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to 10 % of the peak (or the peak throughout: constant)."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def optimizer_class(cfg: TrainConfig):
    """AdamW: torch's, or torchao's AdamW8bit with stochastic rounding of bf16 weights."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ValueError("optimizer='adamw8bit' needs torchao: pip install 'oomb[torchao]'") from e
    return partial(AdamW8bit, bf16_stochastic_round=True)


def make_optimizer(params: list, cfg: TrainConfig, shard_group=None) -> torch.optim.Optimizer:
    """cfg.optimizer; with `shard_group`, torch's ZeroRedundancyOptimizer over it (each rank keeps
    the state of its share of the parameters, and every rank ends the step with all of them)."""
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    cls = optimizer_class(cfg)
    if shard_group is None:
        return cls(params, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=shard_group, **kwargs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Device bytes the optimizer's state will take at its first step: of this rank's share
    under ZeRO-1 (its partition is uneven by up to the largest parameter, so it is counted, not
    divided). AdamW: exp_avg and exp_avg_sq like each parameter; AdamW8bit: a byte per value and
    an fp32 scale per block of each moment for the tensors it quantizes (torchao's rule), like
    AdamW for the others."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    params = [local_tensor(p) for g in local.param_groups for p in g["params"]]
    block = getattr(local, "block_size", None)  # torchao's low-bit optimizers
    total = 0
    for p in params:
        if block and p.numel() >= 4096 and p.numel() % block == 0:
            total += 2 * (p.numel() + 4 * (p.numel() // block) + 4 * 256)  # codes, scales, the code map
        else:
            total += 2 * p.numel() * p.element_size()  # a DTensor's state is its shard's
    return total


def lost_update_fraction(params: list, lr: float) -> float:
    """Share of the bf16 values among `params` that an update of size lr cannot change: a bf16
    step is more than 2^-8 |w|, so at |w| >= 512 lr an update of lr is below half a step and
    round-to-nearest puts w back. Adam's updates are about lr at most: under torch's AdamW these
    weights stay where they are."""
    low = [local_tensor(p) for p in params if p.dtype == torch.bfloat16]
    total = sum(p.numel() for p in low)
    if not total:
        return 0.0
    with torch.no_grad():
        frozen = sum((p.detach().abs() >= 512 * lr).sum() for p in low)
    return int(frozen) / total  # one device sync


def _stopped_by_signal(interrupt: Interrupt, cfg: TrainConfig, step: int, save, rank0: bool,
                       distributed: bool) -> None:
    """After a signal: a checkpoint of the last finished step, how to resume, exit 128 + signal."""
    path = save(step) if cfg.saves and step > 0 else ""
    if rank0:
        if path:
            argv = [a for i, a in enumerate(sys.argv) if a != "--resume" and (i == 0 or sys.argv[i - 1] != "--resume")
                    and not a.startswith("--resume=")]
            command = shlex.join(["oomb" if os.path.basename(argv[0]) in ("oomb", "cli.py") else argv[0], *argv[1:],
                                  "--resume", path])
            print(f"oomb train: stopped by {interrupt.name} after step {step} of {cfg.steps}; checkpoint {path}\n"
                  f"resume with: {command}", flush=True)
        else:
            why = "no --output-dir" if not cfg.output_dir else "--no-save" if not cfg.save else "no step had finished"
            print(f"oomb train: stopped by {interrupt.name} after step {step} of {cfg.steps}; no checkpoint ({why})",
                  flush=True)
    interrupt.disarm()
    if distributed:
        dist.destroy_process_group()
    raise SystemExit(interrupt.exit_code())


def rope_summary(config) -> str:
    p = getattr(config, "rope_parameters", None) or {}
    extra = f" x{p['factor']:g}" if "factor" in p else ""
    return f"RoPE {p.get('rope_type', 'default')}{extra} theta {p.get('rope_theta', 0):g}, "


def kept_attention(engine: ChunkRecurrentEngine) -> str:
    """What the engine keeps of stage 1's attention (for the run's first line)."""
    kept = engine.kept
    if not kept.layers:
        return ""
    return f"kept attention ({len(kept.layers)} of {engine.adapter.n_layers - 1} layers, {kept.where}), "


def recall_task(cfg) -> RecallTask:
    return RecallTask(cfg.recall_keys, cfg.recall_values, cfg.recall_first_id)


def heldout_batches(cfg: TrainConfig, vocab: int, dp_rank: int, recall: RecallMix | None = None
                    ) -> list[tuple[torch.Tensor, ...]]:
    """The evaluation set: `eval_batches` batches drawn once, so every evaluation sees the
    same tokens and their losses compare (each data-parallel rank its own share; a document
    file's sequences in an order of the rank's own). recall: the held-out sequences carry recall
    pairs too (their own draw)."""
    source = cfg.eval_data or cfg.data
    if cfg.eval_data and source != "copy" and data_layout(source, cfg.pack) == "windows":
        # a held-out token file: its first windows, each rank its own
        data = load_tokens(source, vocab, cfg.seq_len, cfg.data_dtype, "--eval-data")
        first = dp_rank * cfg.eval_batches * cfg.batch
        need = first + cfg.eval_batches * cfg.batch
        if (len(data) - 1) // cfg.seq_len < need:
            raise ValueError(f"--eval-data {source} holds {(len(data) - 1) // cfg.seq_len} windows of seq_len="
                             f"{cfg.seq_len:,}; {need} are needed (eval_batches x batch x data-parallel ranks)")
        batches = windows(data[first * cfg.seq_len :], cfg.seq_len, cfg.batch, cfg.eval_batches * cfg.batch)
        return list(recall.mix(batches, 7_919 + dp_rank) if recall is not None else batches)
    data = make_data(source, vocab, cfg.seq_len, cfg.batch, seed=cfg.seed + 7_919 + 100_003 * dp_rank,
                     dtype=cfg.data_dtype, needles=recall, pack=cfg.pack, drop_long=cfg.drop_long)
    return [next(data) for _ in range(cfg.eval_batches)]


def positions(batch: tuple) -> dict:
    """The engine's keyword for a batch's position_ids: packed batches are (input_ids, labels,
    position_ids), the others (input_ids, labels)."""
    return {"position_ids": batch[2]} if len(batch) == 3 else {}


@torch.no_grad()
def evaluate(engine: ChunkRecurrentEngine, model: torch.nn.Module, batches: list, dp_group,
             device: torch.device, recall: RecallTask | None = None) -> tuple[float, int, dict]:
    """Mean loss per predicted token over `batches` (and every data-parallel rank's), in eval
    mode; the page pool is the training step's. recall: also the recall pairs' accuracy by
    distance bucket (data/recall.py), {bucket name: accuracy}."""
    model.eval()
    vocab, edges = engine.adapter.vocab_size, default_edges(batches[0][0].shape[1])
    tally = Tally(edges) if recall is not None else None
    try:
        total = torch.zeros(2, dtype=torch.float64, device=device)  # CE sum, predicted tokens
        for batch in batches:
            result = engine.evaluate(batch[0], batch[1], per_token=tally is not None, **positions(batch))
            total += torch.stack([result.loss.double() * result.num_tokens,
                                  torch.tensor(float(result.num_tokens), dtype=torch.float64, device=device)])
            if tally is not None:
                ids = batch[0].numpy()
                rows, a, b = queries(ids, batch[1].numpy(), recall, vocab)
                tally.add(bucket_of(a, b, engine.chunk_size, edges), *answers(result, ids, rows, b))
    finally:
        model.train()
    if dist.is_initialized():
        dist.all_reduce(total, group=dp_group)
        if tally is not None:
            counts = torch.from_numpy(np.stack([tally.found, tally.count])).to(device)
            dist.all_reduce(counts, group=dp_group)
            tally.found, tally.count = (x.cpu().numpy() for x in counts)
    accuracy = {} if tally is None else {r["bucket"]: r["accuracy"] for r in tally.rows() if r["queries"]}
    return float(total[0] / total[1]), int(total[1]), accuracy


@torch.no_grad()
def copy_losses(engine: ChunkRecurrentEngine, model: torch.nn.Module, batches: list, dp_group,
                device: torch.device) -> tuple[float, float]:
    """The copy task's mean loss on the first (random) half and on the copied half of `batches`
    (and every data-parallel rank's), in eval mode: whether the model retrieves tokens from half
    a sequence back."""
    model.eval()
    try:
        total = torch.zeros(2, 2, dtype=torch.float64, device=device)  # (half, [CE sum, tokens])
        for batch in batches:
            total += torch.stack(copy_halves(engine.evaluate(batch[0], batch[1], per_token=True).token_losses))
    finally:
        model.train()
    if dist.is_initialized():
        dist.all_reduce(total, group=dp_group)
    return float(total[0, 0] / total[0, 1]), float(total[1, 0] / total[1, 1])


def train(cfg: TrainConfig, kernels: KernelOptions | None = None, callbacks=()) -> list[float]:
    """Run cfg.steps optimizer steps; returns the loss of every step. kernels: the engine's
    KernelOptions (the command line passes KernelOptions.from_env(os.environ)). callbacks: objects
    with on_step_end / on_evaluate / on_save ... hooks (train/callbacks.py), called on rank 0 before
    cfg.report_to's trackers; one can stop the run.

    Under torchrun (WORLD_SIZE > 1) the ranks form a (data-parallel, tensor-parallel) mesh:
    `cfg.tp` ranks share each sequence, the rest each take their own; rank 0 logs and saves.
    """
    hooks = CallbackList([*callbacks, *trackers(cfg)])  # a tracker's missing package: an error before any compute
    torch.manual_seed(cfg.seed)
    distributed = world_size() > 1
    if cfg.tp > 1 and not distributed:
        raise ValueError(f"tp={cfg.tp} needs {cfg.tp} processes: launch with torchrun --nproc-per-node {cfg.tp} ...")
    mesh = init_distributed(cfg.tp, cfg.process_group_timeout) if distributed else None
    rank0 = not distributed or dist.get_rank() == 0
    cfg, lock = open_output_dir(cfg, rank0)  # refusals, the lock, --resume latest resolved: before any compute
    hooks = hooks if rank0 else CallbackList()
    threads = torch.get_num_threads()
    try:
        return train_loop(set_up(cfg, kernels, mesh, rank0), hooks)
    finally:
        hooks.end()
        torch.set_num_threads(threads)  # set_up may take one (cpu_threads)
        if lock is not None:
            lock.release()


#: CPU runs of models up to this hidden size compute on one thread (cpu_threads)
ONE_THREAD_HIDDEN = 128


def cpu_threads(model_config, device: torch.device) -> None:
    """One intra-op thread for a small model on the CPU, unless OMP_NUM_THREADS says otherwise:
    its ops are too small for threads to gain (the tiny preset: 20-25K tokens/s on one thread or
    two), and two threads that wait on each other made the demo's 400 steps take 5 min instead of
    28 s while other processes held the 2 cores (docs/experiments.md)."""
    if device.type == "cpu" and model_config.hidden_size <= ONE_THREAD_HIDDEN and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


@dataclasses.dataclass
class Run:
    """What set_up() builds for the loop: this rank's place in the mesh, the model with its
    optimizer and schedule, the engine, the data; and where the run stands (its last finished
    step, the losses of the steps this process ran, the checkpoints it wrote)."""
    cfg: TrainConfig
    rank0: bool
    distributed: bool
    device: torch.device
    dp_group: object  # the process groups (None in a single process)
    tp_group: object
    dp_size: int
    model: torch.nn.Module
    params: list  # the trainable parameters
    masters: MasterWeights | None  # their fp32 masters, which the optimizer steps (master_weights)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: ChunkRecurrentEngine | None  # replaced when the first step is retried smaller
    choice: Choice | None  # oomb.auto's choice of the engine's settings; None when all were given
    data: Iterator
    held_out: list  # the evaluation batches (none without eval_every)
    vocab: int
    step: int  # a resumed run starts at its checkpoint's
    losses: list[float] = dataclasses.field(default_factory=list)
    saved: dict[int, str] = dataclasses.field(default_factory=dict)  # step -> its checkpoint's directory
    save_s: float = 0.0  # the time the last checkpoint took


def set_up(cfg: TrainConfig, kernels: KernelOptions | None, mesh, rank0: bool) -> Run:
    """Everything before step 1 once the output directory is this run's: the device, the model
    (tensor-parallel over the mesh), the optimizer (ZeRO-1 under data parallelism), the engine,
    the data, a resumed run's state, and the run's first line."""
    distributed = mesh is not None
    dp_group = mesh["dp"].get_group() if mesh is not None else None
    dp_rank, dp_size = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if mesh is not None else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if distributed and torch.cuda.is_available() \
        else resolve_device("cpu" if distributed else cfg.device)
    # ZeRO-1: with data parallelism each rank updates (and keeps AdamW's state for) 1/dp of the
    # parameters, then broadcasts them: the memory saved goes to pages ('auto').
    zero = distributed and dp_size > 1 and cfg.tp == 1 and cfg.shard_optimizer
    if why := refusal(cfg, weight_dtype(cfg, device), zero):
        raise ValueError(why)
    check_model_fits(cfg, device, dp_size)
    if rank0 and (note := float32_note(cfg, device)):
        print(note, flush=True)
    model = build_model(cfg, device)
    cpu_threads(model.config, device)
    if mesh is not None and cfg.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    params = [p for p in model.parameters() if p.requires_grad]
    masters = MasterWeights(model, cfg.param_grad_dtype == "float32") if cfg.master_weights != "none" else None
    optimizer = make_optimizer(params if masters is None else masters.masters, cfg, dp_group if zero else None)
    settings, choice = run_engine_config(cfg, model, device, optimizer, kernels)
    compile_layers = settings.compile_layers
    if rank0 and choice is not None:
        print(f"oomb train: {choice.summary()}", flush=True)
    try:
        engine = ChunkRecurrentEngine(model, settings)
    except ValueError as e:
        if cfg.compile is None and compile_layers:
            why = f"--tp {cfg.tp}" if cfg.tp > 1 else f"--float8 {cfg.float8}" if cfg.float8 != "none" else "CUDA"
            raise ValueError(f"{e} (--compile is on by default with {why}: pass --no-compile)") from e
        raise
    if rank0 and cfg.output_dir:
        write_resolved(cfg, engine, device)
    vocab = engine.adapter.vocab_size
    # Ranks of one tensor-parallel group read the same data; data-parallel ranks their own. A
    # token file is checked here, before pinning host memory takes its minute.
    how = data_layout(cfg.data, cfg.pack)
    if cfg.loss_last and how != "windows":
        raise ValueError(f"loss_last={cfg.loss_last} trims the labels of windows; {cfg.data} is trained as documents "
                         f"({how}), whose labels are their own (chat: the assistant's tokens): drop --loss-last")
    needles = None
    if cfg.needle_rate:
        needles = NeedleMix(codec_for(cfg.tokenizer, cfg.model, vocab), cfg.needle_template, cfg.needle_rate,
                            cfg.needles_per_sequence)
    if cfg.recall_pairs:
        needles = RecallMix(recall_task(cfg), cfg.recall_pairs, vocab)
    data = make_data(cfg.data, vocab, cfg.seq_len, cfg.batch, seed=cfg.seed + 100_003 * dp_rank,
                     dtype=cfg.data_dtype, needles=needles, pack=cfg.pack, drop_long=cfg.drop_long)
    held_out = heldout_batches(cfg, vocab, dp_rank, needles if cfg.recall_pairs else None) if cfg.eval_every else []
    engine.reserve(cfg.batch, cfg.seq_len)  # pages (and pinned host memory) once, checked before step 1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    step = checkpoint.load(cfg.resume, model, optimizer, scheduler, cfg, masters) if cfg.resume else 0
    if cfg.resume and rank0 and (note := resume_note(cfg, optimizer, scheduler)):
        print(note, flush=True)
    for _ in range(step * cfg.grad_accum):  # a resumed run sees the batches it would have seen
        next(data)
    run = Run(cfg=cfg, rank0=rank0, distributed=distributed, device=device, dp_group=dp_group,
              tp_group=mesh["tp"].get_group() if mesh is not None else None, dp_size=dp_size, model=model,
              params=params, masters=masters, optimizer=optimizer, scheduler=scheduler, engine=engine, choice=choice,
              data=data, held_out=held_out, vocab=vocab, step=step)

    frozen = lost_update_fraction(params, cfg.lr) if cfg.optimizer == "adamw" and masters is None else 0.0
    if rank0 and frozen > 0.01:
        print(f"oomb train: warning: bf16 weights with torch's AdamW round away updates below half a bf16 step: at "
              f"lr={cfg.lr:g}, {100 * frozen:.1f} % of the trainable weights (|w| >= {512 * cfg.lr:.2g}) cannot "
              "change; use --master-weights float32, --optimizer adamw8bit (stochastic rounding), --dtype float32 or "
              "--lora-rank",
              flush=True)
    if rank0:
        print(first_line(run, how, zero, compile_layers), flush=True)
    return run


def first_line(run: Run, how: str, zero: bool, compile_layers: bool) -> str:
    """The run's first line: the model, the parallel layout, the engine's settings and what the
    data and the optimizer do. how: the data's layout (data_layout); zero: ZeRO-1."""
    cfg, engine = run.cfg, run.engine
    n_params = sum(p.numel() for p in run.params)
    accum = f"{cfg.grad_accum} micro-batches of " if cfg.grad_accum > 1 else ""
    layout = f", {run.dp_size} data-parallel x {cfg.tp} tensor-parallel ranks" if run.distributed else ""
    layout += " (optimizer state sharded: ZeRO-1)" if zero else ""
    return (f"oomb train: {cfg.model} ({n_params / 1e6:.2f}M trainable params) "
            f"on {run.device}{layout}, backend {engine.backend}, offload {engine.config.offload}, "
            f"{accum}{cfg.batch} x {cfg.seq_len:,} tokens a step{' per rank' if run.dp_size > 1 else ''}"
            f"{' (packed documents)' if how == 'packed' else ' (a document each)' if how == 'documents' else ''}, "
            f"chunk {engine.chunk_size}, page {cfg.page_size}, "
            f"{f'sparse top-{cfg.sparse_budget} pages' if cfg.sparse_budget else 'dense'} attention, "
            f"{f'dense layers {cfg.sparse_dense_layers}, ' if cfg.sparse_budget and cfg.sparse_dense_layers else ''}"
            f"{rope_summary(run.model.config) if cfg.rope_theta or cfg.rope_scaling else ''}"
            f"{f'needles in {cfg.needle_rate:.0%} of sequences, ' if cfg.needle_rate else ''}"
            f"{f'{cfg.recall_pairs} recall pairs a sequence, ' if cfg.recall_pairs else ''}"
            f"{f'loss on the last {cfg.loss_last:,} tokens, ' if cfg.loss_last else ''}"
            f"{f'float8 {cfg.float8} layers, ' if cfg.float8 != 'none' else ''}"
            f"{'compiled layers, ' if compile_layers else ''}{kept_attention(engine)}"
            f"optimizer {cfg.optimizer}{', fp32 master weights' if run.masters is not None else ''}"
            f"{', fp32 gradient sums' if engine.summed_params() else ''}, "
            f"{cfg.steps} step{'s' if cfg.steps != 1 else ''}")


def train_loop(run: Run, hooks: CallbackList) -> list[float]:
    """Steps until cfg.steps, a callback's stop or a signal the ranks agree on: after each, its
    line and row (a non-finite step skipped, the run stopped after max_bad_steps in a row), then
    evaluation and checkpoint when due, the callbacks asked after each; at the end the export.
    Returns the losses of the steps this process ran."""
    cfg, rank0 = run.cfg, run.rank0
    hooks.begin(run.step, dataclasses.asdict(resolved_config(cfg, run.engine, run.device)))
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl") if cfg.output_dir and rank0 else None
    if metrics:  # a resumed run writes the rows after its step again
        truncate_metrics(metrics, run.step)
    logger = StepLogger(cfg.steps, run.device, metrics=metrics)
    interrupt = Interrupt(announce=rank0, shutdown_timeout_s=cfg.shutdown_timeout)
    stop_group = host_group(cfg.process_group_timeout) if run.distributed else None
    # a stop waits for the chunk pass in progress, the next (Interrupt.agreed reads the flag a pass late) and,
    # on a GPU, those queued ahead of it
    stop_passes = 2 + (HOST_LEAD_CHUNKS if run.device.type == "cuda" else 0)
    save = partial(save_checkpoint, run, interrupt)
    # stopped: the ranks agreed to stop (a signal after the last agreement is not acted on by its rank alone:
    # the ranks would part at the next collective)
    bad, stopped = 0, False
    stop = False  # a callback asked to stop: this step is the run's last
    try:
        while run.step < cfg.steps and not stop:
            done = train_step(run, micro_batches(run), interrupt, stop_group)
            if done is None:  # abandoned at a chunk pass the ranks agreed on
                stopped = True
                break
            bad = 0 if done.finite else bad + 1
            run.step += 1
            run.losses.append(done.loss)
            step = run.step
            row = log_step(run, logger, done, bad)  # this step's metrics.jsonl row, if it is logged
            if row is not None:
                hooks.step_end(step, row)
            stop = hooks.agreed(stop_group)
            if bad >= cfg.max_bad_steps:
                where = f"; the weights of step {step - bad} are in {save(step)}" if cfg.saves else ""
                raise TrainingStopped(f"{bad} steps in a row had a non-finite loss or gradient norm (steps "
                                      f"{step - bad + 1}-{step}){where}. Lower --lr (now {cfg.lr:g}), check the data "
                                      "of those steps, or raise --max-bad-steps")
            if run.held_out and (step % cfg.eval_every == 0 or step == cfg.steps or stop):
                t0 = time.perf_counter()
                eval_loss, eval_tokens, recall = evaluate(run.engine, run.model, run.held_out, run.dp_group,
                                                          run.device, recall_task(cfg) if cfg.recall_pairs else None)
                if rank0:
                    hooks.evaluate(step, logger.log_eval(step, eval_loss, eval_tokens, time.perf_counter() - t0,
                                                         recall))
                stop = hooks.agreed(stop_group)
            if cfg.saves and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop):
                hooks.save(step, save(step))
                stop = hooks.agreed(stop_group)
            if len(run.losses) > 1:  # the run's first step compiles and warms up: not a pass's time
                passes = cfg.grad_accum * (2 * -(-cfg.seq_len // run.engine.chunk_size) - 1)  # the step's chunk passes
                interrupt.check_time(done.seconds / passes, stop_passes, run.save_s)
            if interrupt.agreed(stop_group):  # a signal after the step's last chunk pass
                stopped = True
                break
    finally:
        interrupt.restore()
    interrupt.settle()  # the flag's last all-reduce, before any process group is destroyed
    if stopped:
        _stopped_by_signal(interrupt, cfg, run.step, save, rank0, run.distributed)
    return finish(run, logger)


def micro_batches(run: Run) -> list[tuple[torch.Tensor, ...]]:
    """The next step's cfg.grad_accum batches (with loss_last, the labels before the last
    loss_last tokens set to -100), their token ids checked against the model's vocabulary."""
    cfg = run.cfg
    micro = [next(run.data) for _ in range(cfg.grad_accum)]
    if cfg.loss_last:  # a long prompt without loss, then the part that is learnt
        micro = [(ids, torch.cat([torch.full_like(labels[:, : -cfg.loss_last], -100),
                                  labels[:, -cfg.loss_last :]], dim=1)) for ids, labels in micro]
    for input_ids, *_ in micro:
        if int(input_ids.max()) >= run.vocab:
            raise ValueError(f"token id {int(input_ids.max())} in the data is >= the model's vocab_size="
                             f"{run.vocab}; the data was tokenised for another model")
    return micro


@dataclasses.dataclass(frozen=True)
class StepResult:
    """A step that ran to its end: the loss (every rank's tokens), the gradient norm before
    clipping, whether both were finite (else the optimizer step was skipped), its input tokens
    on every data-parallel rank, and its seconds."""
    loss: float
    grad_norm: float
    finite: bool
    tokens: int
    seconds: float


def train_step(run: Run, micro: list, interrupt: Interrupt, stop_group) -> StepResult | None:
    """One optimizer step over the micro-batches `micro`: their gradients summed (over the
    data-parallel ranks too), clipped, and the optimizer stepped when loss and norm are finite;
    the schedule steps either way. None: the ranks agreed to stop during it (nothing updated).
    The first step of a single process whose settings oomb.auto chose is retried one notch
    smaller when it runs out of GPU memory (retry_smaller); any other out-of-memory is raised."""
    cfg, optimizer = run.cfg, run.optimizer
    t0 = time.perf_counter()
    # One denominator for the whole step: the predicted tokens of every micro-batch on every
    # data-parallel rank, so the summed gradients are those of one big batch.
    count = global_token_count(torch.cat([batch[1] for batch in micro]), run.dp_group)  # one all-reduce

    def progress_of(bar):
        def progress(done: int, total: int) -> None:
            bar(done, total)
            if interrupt.agreed(stop_group):  # every rank after the same chunk pass: stop now
                raise StepAbandoned
        return progress

    while True:
        loss_t = torch.zeros((), dtype=torch.float32, device=run.device)
        try:
            for m, batch in enumerate(micro):
                desc = f"step {run.step + 1}" + (f" [{m + 1}/{cfg.grad_accum}]" if cfg.grad_accum > 1 else "")
                with chunk_progress(desc, enabled=run.rank0) as bar:
                    loss_t += run.engine.forward_backward(batch[0], batch[1], num_tokens=count,
                                                          progress=progress_of(bar), **positions(batch)).loss
            break
        except StepAbandoned:  # the engine has freed the step's pages; no parameter was updated
            run.model.zero_grad(set_to_none=True)  # what the step had added is dropped with it
            return None
        except torch.OutOfMemoryError as e:
            # The plan was wrong: the run's first step is retried one notch smaller
            # (a single process: ranks would disagree on where they are).
            if run.losses or run.choice is None or run.distributed:
                raise
            oom = str(e).splitlines()[0][:200]
        retry_smaller(run, oom)  # out of the except block, whose traceback held the failed step's tensors
    all_reduce_gradients(run.model, run.dp_group)
    # master weights: the gradients move to the fp32 masters, which are clipped and stepped
    stepped = run.params if run.masters is None else run.masters.take_grads()
    grad_norm = clip_grad_norm_(stepped, cfg.grad_clip, run.tp_group)
    if run.distributed:
        dist.all_reduce(loss_t, group=run.dp_group)  # each rank's CE sum / the global count
    loss = float(loss_t)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)  # the same on every rank
    if finite:
        optimizer.step()
        if run.masters is not None:
            run.masters.copy_back()
    run.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return StepResult(loss, grad_norm, finite, tokens=sum(batch[0].numel() for batch in micro) * run.dp_size,
                      seconds=time.perf_counter() - t0)


def retry_smaller(run: Run, oom: str) -> None:
    """After the first step ran out of GPU memory (`oom`: the error's first line): its gradients
    dropped, the engine freed and built again with oomb.auto's next smaller setting
    (replan_after_oom), its pages reserved, and config.yaml rewritten with what the run now runs."""
    cfg = run.cfg
    run.model.zero_grad(set_to_none=True)
    run.engine = None  # the only reference: its pages are freed before the smaller engine takes its own
    run.choice = replan_after_oom(cfg, run.model, run.device, run.choice, run.optimizer, oom)
    run.engine = ChunkRecurrentEngine(run.model, run.choice.engine)
    run.engine.reserve(cfg.batch, cfg.seq_len)
    if cfg.output_dir:  # a single process (rank 0): the settings it now runs
        write_resolved(cfg, run.engine, run.device)


def log_step(run: Run, logger: StepLogger, done: StepResult, bad: int) -> dict | None:
    """Rank 0's line and metrics.jsonl row for the step just run (run.step), when it is logged:
    a skipped step always, the others every log_every steps and the last. Returns the row (for
    the callbacks) or None."""
    cfg, step = run.cfg, run.step
    if run.rank0 and not done.finite:
        print(f"oomb train: step {step}: loss {done.loss}, gradient norm {done.grad_norm}: not finite, optimizer "
              f"step skipped ({bad} in a row, the run stops at {cfg.max_bad_steps})", flush=True)
        return logger.log_skipped(step, done.loss, done.grad_norm, bad)
    if run.rank0 and (step % cfg.log_every == 0 or step == cfg.steps):
        return logger.log(step, done.loss, done.tokens, done.seconds,
                          float(run.scheduler.get_last_lr()[0]), done.grad_norm,  # torchao keeps lr as a tensor
                          # the layers whose pages offload put on the host: what a soak run exercised
                          {**memory_now(run.device, run.engine.pinned_bytes()),
                           "host_layers": len(run.engine.store.host_layers)})
    return None


def save_checkpoint(run: Run, interrupt: Interrupt, step: int) -> str:
    """The checkpoint of `step` (the last finished), written once: a signal right after a
    scheduled save reuses it. Its weights are checked first; rank 0 names it and then prunes
    past save_total_limit. Its time is what Interrupt.check_time counts for a stop's checkpoint."""
    cfg = run.cfg
    if step not in run.saved:
        check_finite_weights(run.model, step, run.losses, cfg)
        t0 = time.perf_counter()
        path = checkpoint.save(cfg.output_dir, step, run.model, run.optimizer, run.scheduler, cfg, write=run.rank0,
                               masters=run.masters)
        run.saved[step] = str(path)
        run.save_s = time.perf_counter() - t0
        interrupt.newest_checkpoint = run.saved[step]
        if run.rank0:
            print(f"saved {path}", flush=True)
        if run.rank0 and cfg.save_total_limit:  # only after the new one is in place and verified
            for old in checkpoint.prune(cfg.output_dir, cfg.save_total_limit, path):
                print(f"deleted {old} (--save-total-limit {cfg.save_total_limit})", flush=True)
    return run.saved[step]


def finish(run: Run, logger: StepLogger) -> list[float]:
    """The end of a run that no signal stopped: the model exported (its weights checked, unless
    the checkpoint of this step already was), the process group destroyed. Returns the losses."""
    cfg = run.cfg
    if cfg.saves:
        if run.step not in run.saved:  # save_checkpoint() checked the weights of a step it wrote
            check_finite_weights(run.model, run.step, run.losses, cfg)
        path = checkpoint.export(cfg.output_dir, run.model, cfg.model, write=run.rank0)
        if run.rank0:
            how = "PeftModel.from_pretrained(base, path)" if cfg.lora_rank else "AutoModelForCausalLM.from_pretrained"
            print(f"exported {path} (load with {how})", flush=True)
    if cfg.data == "copy" and not cfg.eval_data:  # the built-in task: was its long-range half learnt?
        dp_rank = dist.get_rank(run.dp_group) if run.distributed else 0
        first, copied = copy_losses(run.engine, run.model, run.held_out or heldout_batches(cfg, run.vocab, dp_rank),
                                    run.dp_group, run.device)
        if run.rank0:
            logger.log_copy(first, copied, copy_entropy(run.vocab), cfg.seq_len // 2,
                            earlier_chunk=run.engine.chunk_size <= cfg.seq_len // 2)
    if run.distributed:
        dist.destroy_process_group()
    return run.losses
