"""The training loop: the engine computes gradients, this owns data, optimizer and state."""
from __future__ import annotations

import gc
import math
import os
import shlex
import sys
import time
import warnings
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..attention.sparse import TopKPages
from ..auto import Choice, Machine, NothingFits, choose, compiles
from ..config import EngineConfig, KernelOptions
from ..engine import HOST_LEAD_CHUNKS, ChunkRecurrentEngine
from ..models.float8 import apply_float8
from ..models.liger import apply_liger
from ..parallel import (all_reduce_gradients, apply_tensor_parallel, clip_grad_norm_, global_token_count,
                        host_group, init_distributed, local_tensor, local_world_size, world_size)
from ..models.rope import check_positions
from ..presets import load_model
from . import checkpoint
from .checks import check_finite_weights, check_model_fits, resume_note, weight_dtype
from .config import TrainConfig
from .data import NeedleMix, copy_entropy, copy_halves, load_tokens, make_data, windows
from .documents import data_layout
from .interrupt import Interrupt, StepAbandoned, TrainingStopped
from .metrics import StepLogger, chunk_progress, memory_now
from .output_dir import open_output_dir, truncate_metrics
from .recall import RecallMix, RecallTask, Tally, answers, bucket_of, default_edges, queries

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    model.train()
    if cfg.liger:
        apply_liger(model)  # before LoRA wraps the projections: Liger patches the norm and MLP modules
    if cfg.lora_rank:
        import peft

        lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                               target_modules=LORA_TARGETS)
        with warnings.catch_warnings():  # peft asks transformers 5's deprecated name, once per model
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = peft.get_peft_model(model, lora)
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
                        backend=cfg.backend, offload=cfg.offload, sparse=sparse_config(cfg),
                        param_grad_dtype=torch.float32 if cfg.param_grad_dtype == "float32" else None,
                        keep_attention=cfg.keep_attention,
                        kept_host_bytes=None if cfg.kept_host_gib is None else int(cfg.kept_host_gib * 2**30),
                        kernels=kernels or KernelOptions(), **extra)


def plan_args(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg) -> dict:
    """What oomb.plan.plan() needs of this run beside the engine's settings: this rank's
    parameter counts, the optimizer state per trainable parameter, the weights' dtype, TP."""
    params = list(model.parameters())
    trainable = sum(local_tensor(p).numel() for p in params if p.requires_grad)
    return dict(n_params=sum(local_tensor(p).numel() for p in params), trainable_params=trainable,
                optimizer_bytes_per_param=-(-optimizer_state_bytes(optimizer) // max(1, trainable)),
                dtype=params[0].dtype, tp=cfg.tp)


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


def sparse_config(cfg) -> TopKPages | None:
    """TopKPages from the sparse_* settings of a TrainConfig or of `oomb eval`'s flags (a chunk
    budget of 0 is TopKPages' default, max(256, budget); one below the budget is raised to it;
    TrainConfig refuses one before this)."""
    if not cfg.sparse_budget:
        return None
    chunk_budget = max(cfg.sparse_chunk_budget, cfg.sparse_budget) if cfg.sparse_chunk_budget else None
    return TopKPages(budget=cfg.sparse_budget, chunk_budget=chunk_budget,
                     sink_pages=cfg.sparse_sink_pages, representative=cfg.sparse_representative,
                     dense_layers=parse_layers(cfg.sparse_dense_layers))


def parse_layers(text: str) -> tuple[int, ...]:
    """'-2,-1' -> (-2, -1)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"sparse_dense_layers={text!r} must be comma-separated layer indices, e.g. -2,-1") from None


def codec_for(tokenizer: str, model: str, vocab_size: int):
    """What encodes needle text for this model: --tokenizer, else the checkpoint's own tokenizer,
    else bytes for a byte-level vocabulary (a preset, or a checkpoint trained on bytes)."""
    from ..presets import PRESETS
    from .needles import make_codec

    if tokenizer:
        return make_codec(tokenizer, vocab_size)
    if model not in PRESETS:
        try:
            return make_codec(model, vocab_size)
        except ValueError:
            if vocab_size != 256:
                raise
    if vocab_size != 256:
        raise ValueError(f"{model} has no tokenizer and a vocabulary of {vocab_size:,}, not bytes: pass --tokenizer "
                         "(a checkpoint directory with tokenizer files)")
    return make_codec("bytes", vocab_size)


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
    distance bucket (train/recall.py), {bucket name: accuracy}."""
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


def train(cfg: TrainConfig, kernels: KernelOptions | None = None) -> list[float]:
    """Run cfg.steps optimizer steps; returns the loss of every step. kernels: the engine's
    KernelOptions (the command line passes KernelOptions.from_env(os.environ)).

    Under torchrun (WORLD_SIZE > 1) the ranks form a (data-parallel, tensor-parallel) mesh:
    `cfg.tp` ranks share each sequence, the rest each take their own; rank 0 logs and saves.
    """
    torch.manual_seed(cfg.seed)
    distributed = world_size() > 1
    if cfg.tp > 1 and not distributed:
        raise ValueError(f"tp={cfg.tp} needs {cfg.tp} processes: launch with torchrun --nproc-per-node {cfg.tp} ...")
    mesh = init_distributed(cfg.tp, cfg.process_group_timeout) if distributed else None
    rank0 = not distributed or dist.get_rank() == 0
    cfg, lock = open_output_dir(cfg, rank0)  # refusals, the lock, --resume latest resolved: before any compute
    threads = torch.get_num_threads()
    try:
        return _run(cfg, kernels, mesh, rank0)
    finally:
        torch.set_num_threads(threads)  # _run may take one (cpu_threads)
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


def _run(cfg: TrainConfig, kernels: KernelOptions | None, mesh, rank0: bool) -> list[float]:
    """train() once the output directory is this run's."""
    distributed = mesh is not None
    dp_group = mesh["dp"].get_group() if mesh is not None else None
    dp_rank, dp_size = (mesh["dp"].get_local_rank(), mesh["dp"].size()) if mesh is not None else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if distributed and torch.cuda.is_available() \
        else resolve_device("cpu" if distributed else cfg.device)
    check_model_fits(cfg, device, dp_size)
    model = build_model(cfg, device)
    cpu_threads(model.config, device)
    if mesh is not None and cfg.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    params = [p for p in model.parameters() if p.requires_grad]
    # ZeRO-1: with data parallelism each rank updates (and keeps AdamW's state for) 1/dp of the
    # parameters, then broadcasts them: the memory saved goes to pages ('auto').
    zero = distributed and dp_size > 1 and cfg.tp == 1 and cfg.shard_optimizer
    optimizer = make_optimizer(params, cfg, dp_group if zero else None)
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
    step = checkpoint.load(cfg.resume, model, optimizer, scheduler, cfg) if cfg.resume else 0
    if cfg.resume and rank0 and (note := resume_note(cfg, optimizer, scheduler)):
        print(note, flush=True)
    for _ in range(step * cfg.grad_accum):  # a resumed run sees the batches it would have seen
        next(data)

    n_params = sum(p.numel() for p in params)
    frozen = lost_update_fraction(params, cfg.lr) if cfg.optimizer == "adamw" else 0.0
    if rank0 and frozen > 0.01:
        print(f"oomb train: warning: bf16 weights with torch's AdamW round away updates below half a bf16 step: at "
              f"lr={cfg.lr:g}, {100 * frozen:.1f} % of the trainable weights (|w| >= {512 * cfg.lr:.2g}) cannot "
              "change; use --optimizer adamw8bit (stochastic rounding), --dtype float32 or --lora-rank",
              flush=True)
    if rank0:
        accum = f"{cfg.grad_accum} micro-batches of " if cfg.grad_accum > 1 else ""
        layout = f", {dp_size} data-parallel x {cfg.tp} tensor-parallel ranks" if distributed else ""
        layout += " (optimizer state sharded: ZeRO-1)" if zero else ""
        print(f"oomb train: {cfg.model} ({n_params / 1e6:.2f}M trainable params) "
              f"on {device}{layout}, backend {engine.backend}, offload {engine.config.offload}, "
              f"{accum}{cfg.batch} x {cfg.seq_len:,} tokens a step{' per rank' if dp_size > 1 else ''}"
              f"{' (packed documents)' if how == 'packed' else ' (a document each)' if how == 'documents' else ''}, "
              f"chunk {engine.chunk_size}, page {cfg.page_size}, "
              f"{f'sparse top-{cfg.sparse_budget} pages' if cfg.sparse_budget else 'dense'} attention, "
              f"{f'dense layers {cfg.sparse_dense_layers}, ' if cfg.sparse_budget and cfg.sparse_dense_layers else ''}"
              f"{rope_summary(model.config) if cfg.rope_theta or cfg.rope_scaling else ''}"
              f"{f'needles in {cfg.needle_rate:.0%} of sequences, ' if cfg.needle_rate else ''}"
              f"{f'{cfg.recall_pairs} recall pairs a sequence, ' if cfg.recall_pairs else ''}"
              f"{f'loss on the last {cfg.loss_last:,} tokens, ' if cfg.loss_last else ''}"
              f"{f'float8 {cfg.float8} layers, ' if cfg.float8 != 'none' else ''}"
              f"{'compiled layers, ' if compile_layers else ''}{kept_attention(engine)}"
              f"optimizer {cfg.optimizer}{', fp32 gradient sums' if engine.summed_params() else ''}, "
              f"{cfg.steps} steps", flush=True)
    metrics = os.path.join(cfg.output_dir, "metrics.jsonl") if cfg.output_dir and rank0 else None
    if metrics:  # a resumed run writes the rows after its step again
        truncate_metrics(metrics, step)
    logger = StepLogger(cfg.steps, device, metrics=metrics)
    tp_group = mesh["tp"].get_group() if mesh is not None else None
    interrupt = Interrupt(announce=rank0, shutdown_timeout_s=cfg.shutdown_timeout)
    stop_group = host_group(cfg.process_group_timeout) if distributed else None
    # a stop waits for the chunk pass in progress, the next (Interrupt.agreed reads the flag a pass late) and,
    # on a GPU, those queued ahead of it
    stop_passes = 2 + (HOST_LEAD_CHUNKS if device.type == "cuda" else 0)
    saved, save_s = {}, 0.0

    def save(step: int) -> str:
        nonlocal save_s
        if step not in saved:  # a signal right after a scheduled save reuses it
            check_finite_weights(model, step, losses, cfg)
            t0 = time.perf_counter()
            path = checkpoint.save(cfg.output_dir, step, model, optimizer, scheduler, cfg, write=rank0)
            saved[step] = str(path)
            save_s = time.perf_counter() - t0
            interrupt.newest_checkpoint = saved[step]
            if rank0:
                print(f"saved {path}", flush=True)
            if rank0 and cfg.save_total_limit:  # only after the new one is in place and verified
                for old in checkpoint.prune(cfg.output_dir, cfg.save_total_limit, path):
                    print(f"deleted {old} (--save-total-limit {cfg.save_total_limit})", flush=True)
        return saved[step]

    def progress_of(bar):
        def progress(done: int, total: int) -> None:
            bar(done, total)
            if interrupt.agreed(stop_group):  # every rank after the same chunk pass: stop now
                raise StepAbandoned
        return progress

    # stopped: the ranks agreed to stop (a signal after the last agreement is not acted on by its rank alone:
    # the ranks would part at the next collective)
    losses, bad, stopped = [], 0, False
    try:
        while step < cfg.steps:
            micro = [next(data) for _ in range(cfg.grad_accum)]
            if cfg.loss_last:  # a long prompt without loss, then the part that is learnt
                micro = [(ids, torch.cat([torch.full_like(labels[:, : -cfg.loss_last], -100),
                                          labels[:, -cfg.loss_last :]], dim=1)) for ids, labels in micro]
            for input_ids, *_ in micro:
                if int(input_ids.max()) >= vocab:
                    raise ValueError(f"token id {int(input_ids.max())} in the data is >= the model's vocab_size="
                                     f"{vocab}; the data was tokenised for another model")
            t0 = time.perf_counter()
            # One denominator for the whole step: the predicted tokens of every micro-batch on every
            # data-parallel rank, so the summed gradients are those of one big batch.
            count = global_token_count(torch.cat([batch[1] for batch in micro]), dp_group)  # one all-reduce
            loss_t = torch.zeros((), dtype=torch.float32, device=device)
            try:
                while True:
                    try:
                        for m, batch in enumerate(micro):
                            desc = f"step {step + 1}" + (f" [{m + 1}/{cfg.grad_accum}]" if cfg.grad_accum > 1 else "")
                            with chunk_progress(desc, enabled=rank0) as bar:
                                loss_t += engine.forward_backward(batch[0], batch[1], num_tokens=count,
                                                                  progress=progress_of(bar), **positions(batch)).loss
                        break
                    except torch.OutOfMemoryError as e:
                        # The plan was wrong: the run's first step is retried one notch smaller
                        # (a single process: ranks would disagree on where they are).
                        if losses or choice is None or distributed:
                            raise
                        oom = str(e).splitlines()[0][:200]
                    # out of the except block, whose traceback held the failed step's tensors
                    optimizer.zero_grad(set_to_none=True)
                    loss_t.zero_()
                    engine = None
                    choice = replan_after_oom(cfg, model, device, choice, optimizer, oom)
                    engine = ChunkRecurrentEngine(model, choice.engine)
                    engine.reserve(cfg.batch, cfg.seq_len)
            except StepAbandoned:  # the engine has freed the step's pages; no parameter was updated
                optimizer.zero_grad(set_to_none=True)  # what the step had added is dropped with it
                stopped = True
                break
            all_reduce_gradients(model, dp_group)
            grad_norm = clip_grad_norm_(params, cfg.grad_clip, tp_group)
            if distributed:
                dist.all_reduce(loss_t, group=dp_group)  # each rank's CE sum / the global count
            loss = float(loss_t)
            finite = math.isfinite(loss) and math.isfinite(grad_norm)  # the same on every rank
            if finite:
                optimizer.step()
                bad = 0
            else:
                bad += 1
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - t0
            step += 1
            losses.append(loss)
            if rank0 and not finite:
                print(f"oomb train: step {step}: loss {loss}, gradient norm {grad_norm}: not finite, optimizer step "
                      f"skipped ({bad} in a row, the run stops at {cfg.max_bad_steps})", flush=True)
                logger.log_skipped(step, loss, grad_norm, bad)
            elif rank0 and (step % cfg.log_every == 0 or step == cfg.steps):
                logger.log(step, loss, sum(batch[0].numel() for batch in micro) * dp_size, step_s,
                           float(scheduler.get_last_lr()[0]), grad_norm,  # torchao keeps lr as a tensor
                           # the layers whose pages offload put on the host: what a soak run exercised
                           {**memory_now(device, engine.pinned_bytes()), "host_layers": len(engine.store.host_layers)})
            if bad >= cfg.max_bad_steps:
                where = f"; the weights of step {step - bad} are in {save(step)}" if cfg.saves else ""
                raise TrainingStopped(f"{bad} steps in a row had a non-finite loss or gradient norm (steps "
                                      f"{step - bad + 1}-{step}){where}. Lower --lr (now {cfg.lr:g}), check the data "
                                      "of those steps, or raise --max-bad-steps")
            if held_out and (step % cfg.eval_every == 0 or step == cfg.steps):
                t0 = time.perf_counter()
                eval_loss, eval_tokens, recall = evaluate(engine, model, held_out, dp_group, device,
                                                          recall_task(cfg) if cfg.recall_pairs else None)
                if rank0:
                    logger.log_eval(step, eval_loss, eval_tokens, time.perf_counter() - t0, recall)
            if cfg.saves and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps):
                save(step)
            if len(losses) > 1:  # the run's first step compiles and warms up: not a pass's time
                passes = cfg.grad_accum * (2 * -(-cfg.seq_len // engine.chunk_size) - 1)  # the step's chunk passes
                interrupt.check_time(step_s / passes, stop_passes, save_s)
            if interrupt.agreed(stop_group):  # a signal after the step's last chunk pass
                stopped = True
                break
    finally:
        interrupt.restore()
    interrupt.settle()
    if stopped:
        _stopped_by_signal(interrupt, cfg, step, save, rank0, distributed)
    if cfg.saves:
        if step not in saved:  # save() checked the weights of a step it wrote
            check_finite_weights(model, step, losses, cfg)
        path = checkpoint.export(cfg.output_dir, model, cfg.model, write=rank0)
        if rank0:
            how = "PeftModel.from_pretrained(base, path)" if cfg.lora_rank else "AutoModelForCausalLM.from_pretrained"
            print(f"exported {path} (load with {how})", flush=True)
    if cfg.data == "copy" and not cfg.eval_data:  # the built-in task: was its long-range half learnt?
        first, copied = copy_losses(engine, model, held_out or heldout_batches(cfg, vocab, dp_rank), dp_group, device)
        if rank0:
            logger.log_copy(first, copied, copy_entropy(vocab), cfg.seq_len // 2,
                            earlier_chunk=engine.chunk_size <= cfg.seq_len // 2)
    if distributed:
        dist.destroy_process_group()
    return losses
