"""The automatic configuration: the fastest engine settings the memory plan says fit a machine.

`choose()` is the one function `oomb train` (settings left to 'auto'), `oomb plan` and the
benchmarks (`bench/bench_step.py --impls oomb-default`) call, so the three never disagree. It
searches the settings the caller left free, among

  chunk_size          16384, 8192, 4096, 2048, 1024 tokens, at most half the sequence (two chunks
                      or more)
  kv_grad_dtype       float32 (gradients as a full-sequence backward gives them) or bfloat16
                      (half the gradient pages' bytes)
  checkpoint_layers   off, or on (each layer recomputed in backward: least activation memory)

with offload 'auto' (whole layers' pages on the GPU while they fit, the rest in pinned host
memory: 'none' when everything fits, which costs nothing), and keeps those that plan.place()
says fit the GPU (5 % of it left free: plan.gpu_margin()) and the host. Among them it takes the
one of least `step_cost()`: a model of a step's time relative to an unbounded chunk, fitted to
the H200 measurements of docs/benchmarks.md (Qwen2.5-7B shape, 64K tokens):

  1 + CHUNK_PASS_TOKENS / chunk_size   each chunk pass has a fixed cost of about 221 tokens' work:
                                       chunk 4096 vs 16384 0.995x vs 1.037x transformers+Liger,
                                       chunk 1024 vs 4096 0.71x vs 0.82x (eager)
  1 + 712 / chunk_size                 top-k: each query also attends its own chunk's keys densely;
    + 6.32e-5 x chunk_size             fitted to 256K steps, chunk 2048 / 8192 +3 % / +12 % over
                                       4096 (docs/experiments.md): best near 3.3K tokens
  x 1.25 with checkpoint_layers        the layers' forward a second time
  x (1 + 0.02 x share of layers on     offload 'all' / 'auto' measured within -0.9 .. +1.9 % of
     the host)                         'none' (the transfers hide behind compute)
  x 1.02 with bfloat16 dK/dV           not a time (bf16 pages cost no time): a preference for
                                       float32 sums where the cost is otherwise within 2 %

Nothing fitting is an error (`NothingFits`) that names the longest context the most frugal
settings reach, and the settings that would reach further (top-k sparse attention, LoRA).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .attention.sparse import TopKPages
from .config import EngineConfig
from .plan import Fit, MemoryPlan, gpu_margin, human_bytes, longest_context, place, plan

AUTO_FIELDS = ("chunk_size", "kv_grad_dtype", "checkpoint_layers")
CHUNK_SIZES = (16384, 8192, 4096, 2048, 1024)
CHUNK_PASS_TOKENS = 221
SPARSE_CHUNK_PASS_TOKENS, SPARSE_CHUNK_KEYS_COST = 712, 6.32e-5
CHECKPOINT_COST = 1.25
HOST_LAYERS_COST = 0.02
BF16_GRADS_COST = 1.02  # not a time: a preference for float32 dK/dV (exact sums) at near-equal cost
#: model families torch.compile is measured on in the engine (dense decoder layers)
COMPILED_FAMILIES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Machine:
    """The memory a step may use: the GPU's (its capacity, for what this process may allocate)
    and the host's (pinned pages and kept attention outputs). A CPU run has no GPU: its 'GPU'
    is host memory (gpu_bytes is then the host's)."""

    gpu_bytes: int
    host_bytes: int
    cuda: bool = True

    @classmethod
    def measure(cls, device: torch.device, local_world_size: int = 1) -> "Machine":
        """This machine now: the device memory this process may still take plus what it already
        holds (its weights, which the plan counts), within torch.cuda's per-process memory
        fraction, and the host's available memory (shared among the `local_world_size` processes
        of the machine)."""
        from .memory.device import device_memory
        from .memory.pinned import available_host_bytes

        host = available_host_bytes() // local_world_size
        if device.type != "cuda":
            return cls(host, host, cuda=False)
        free, _ = device_memory(device)  # within a per-process memory fraction
        return cls(free + torch.cuda.memory_allocated(device), host)

    def describe(self) -> str:
        if not self.cuda:
            return f"CPU, {human_bytes(self.host_bytes)} of host memory"
        return f"GPU {human_bytes(self.gpu_bytes)}, host {human_bytes(self.host_bytes)}"


@dataclass(frozen=True)
class Choice:
    """The chosen engine settings, the plan of their step and where its bytes go."""

    engine: EngineConfig
    plan: MemoryPlan
    fit: Fit
    cost: float
    chosen: tuple[str, ...]  # the fields chosen here (the others were given)
    machine: Machine
    fitting: int = 1  # settings of the chosen fields that fit

    def settings(self) -> str:
        e, d = self.engine, self.fit.decision
        host = f", {d.host_layers} of {d.host_layers + d.device_layers} layers' pages on the host" \
            if d and d.host_layers else ""
        return (f"chunk {e.chunk_size}, offload {e.offload}{host}, "
                f"{'bf16' if e.kv_grad_dtype == torch.bfloat16 else 'fp32'} dK/dV, "
                f"layers {'recomputed' if e.checkpoint_layers else 'kept'} in backward"
                f"{', compiled layers' if e.compile_layers else ''}")

    def summary(self, planned: bool = True) -> str:
        """One line: what was chosen and why; planned: with the memory it plans (oomb plan prints
        that in its table instead)."""
        how = "chosen" if self.chosen else "given"
        planned_gpu, capacity = self.fit.gpu - gpu_margin(self.fit.gpu_capacity), self.fit.gpu_capacity
        room = (f"GPU {human_bytes(planned_gpu)} of {human_bytes(capacity)}" if self.machine.cuda
                else f"{human_bytes(planned_gpu)} of {human_bytes(capacity)} memory")
        if self.fit.host:
            room += f", host {human_bytes(self.fit.host)} of {human_bytes(self.fit.host_capacity)}"
        why = f"the fastest of the {self.fitting} settings that fit, by oomb.auto's cost model" if self.chosen else ""
        if not planned:
            return f"auto configuration: {self.settings()} ({why or how})"
        return f"auto configuration: {self.settings()} ({how}: {room} planned{'; ' + why if why else ''})"


class NothingFits(ValueError):
    """No setting of the free fields fits the machine."""


def step_cost(engine: EngineConfig, host_share: float = 0.0) -> float:
    """A step's time relative to one with an unbounded chunk (the module's docstring)."""
    c = engine.chunk_size
    if engine.sparse is not None:  # the chunk's own keys are attended densely: a cost that grows with it
        t = 1 + SPARSE_CHUNK_PASS_TOKENS / c + SPARSE_CHUNK_KEYS_COST * c
    else:
        t = 1 + CHUNK_PASS_TOKENS / c
    if engine.checkpoint_layers:
        t *= CHECKPOINT_COST
    if engine.kv_grad_dtype == torch.bfloat16:
        t *= BF16_GRADS_COST
    return t * (1 + HOST_LAYERS_COST * host_share)


def compiles(model_config, device: torch.device, lora: bool) -> bool:
    """compile 'auto': on for CUDA and the dense families compiled layers were measured on, with
    full-parameter gradients (LoRA's wrapped projections under torch.compile are not measured)."""
    return device.type == "cuda" and getattr(model_config, "model_type", "") in COMPILED_FAMILIES and not lora


def chunk_sizes(seq_len: int, page_size: int) -> list[int]:
    """The chunk sizes tried for `seq_len`: the standard ones that leave two chunks or more (a
    step of one chunk is full-sequence training), multiples of the page; for a sequence shorter
    than two of the smallest, a half, a quarter and an eighth of it (in whole pages, one at least)."""
    sizes = [c for c in CHUNK_SIZES if c % page_size == 0 and 2 * c <= seq_len]
    if sizes:
        return sizes
    return sorted({max(page_size, seq_len // d // page_size * page_size) for d in (2, 4, 8)}, reverse=True)


def candidates(base: EngineConfig, free: tuple[str, ...], seq_len: int) -> list[EngineConfig]:
    """Every setting of the `free` fields (AUTO_FIELDS) over `base`, offload 'auto' unless given."""
    chunks = chunk_sizes(seq_len, base.page_size) if "chunk_size" in free else [base.chunk_size]
    dtypes = [torch.float32, torch.bfloat16] if "kv_grad_dtype" in free else [base.kv_grad_dtype]
    recompute = [False, True] if "checkpoint_layers" in free else [base.checkpoint_layers]
    return [base.replace(chunk_size=c, kv_grad_dtype=d, checkpoint_layers=r)
            for d in dtypes for c in chunks for r in recompute]


def choose(model_config, seq_len: int, machine: Machine, base: EngineConfig, free: tuple[str, ...] = AUTO_FIELDS,
           batch: int = 1, below: Choice | None = None, **plan_args) -> Choice:
    """The fastest setting of the `free` fields that fits `machine` (module docstring); with
    `below`, the fastest whose chunk needs less working memory than `below`'s (a retry after it
    ran out).
    plan_args go to plan.plan(): trainable_params, optimizer_bytes_per_param, n_params,
    optimizer_shards, tp, dtype, master_weights."""
    unknown = set(free) - set(AUTO_FIELDS)
    if unknown:
        raise ValueError(f"cannot choose {sorted(unknown)} automatically; the automatic fields are {AUTO_FIELDS}")
    best, fitting = None, 0
    for engine in candidates(base, free, seq_len):
        p, fit = judge(model_config, seq_len, batch, engine, machine, plan_args)
        if not fit.fits or (below is not None and p.working_set >= below.plan.working_set):
            continue
        fitting += 1
        d = fit.decision
        share = d.host_layers / max(1, d.host_layers + d.device_layers) if d else 0.0
        cost = step_cost(engine, share)
        if best is None or cost < best.cost:
            best = Choice(engine, p, fit, cost, tuple(f for f in AUTO_FIELDS if f in free), machine)
    if best is not None:
        return dataclasses.replace(best, fitting=fitting)
    raise NothingFits(_nothing_fits(model_config, seq_len, machine, base, free, batch, below, plan_args))


def frugal(base: EngineConfig, seq_len: int, free: tuple[str, ...] = AUTO_FIELDS) -> EngineConfig:
    """The setting of the `free` fields that needs the least memory (the smallest chunk, bf16 dK/dV,
    layers recomputed): the longest context it fits is the longest the automatic configuration
    reaches, and what the error names when nothing fits."""
    return base.replace(**{k: v for k, v in (("chunk_size", chunk_sizes(seq_len, base.page_size)[-1]),
                                             ("kv_grad_dtype", torch.bfloat16), ("checkpoint_layers", True))
                           if k in free})


def _nothing_fits(model_config, seq_len, machine, base, free, batch, below, plan_args) -> str:
    """The error when nothing fits: what the most frugal settings need, the longest context they
    fit, and what would go further."""
    least = frugal(base, seq_len, free)

    def fit(engine, n, args=plan_args):
        return judge(model_config, n, batch, engine, machine, args)[1]

    p, need = judge(model_config, seq_len, batch, least, machine, plan_args)
    longest = longest_context(lambda n: fit(least, n).fits, least.chunk_size)
    settings = Choice(least, None, need, 0.0, (), machine).settings()
    if below is not None:
        head = (f"no setting needs less working memory than the one that ran out ({below.settings()}: "
                f"{human_bytes(below.plan.working_set)} for one chunk's compute)")
    else:
        head = f"{batch} x {seq_len:,} tokens do not fit this machine ({machine.describe()})"
    msg = (f"{head}. The most frugal settings ({settings}) plan GPU {human_bytes(need.gpu)} (5 % of it left free) "
           f"and host {human_bytes(need.host)}; the longest context they fit is {longest:,} tokens.")
    state, usable = p.weights + p.masters + p.grads + p.optimizer, machine.gpu_bytes - gpu_margin(machine.gpu_bytes)
    gpu_bound = not longest and machine.cuda and state >= usable  # no context at all: host memory cannot help
    if gpu_bound:
        msg += (f" The weights, their gradients and the optimizer state alone take {human_bytes(state)} of the "
                f"{human_bytes(usable)} the GPU may use.")
    if base.sparse is None:
        sparse = least.replace(sparse=TopKPages(budget=64))
        reach = longest_context(lambda n: fit(sparse, n).fits, least.chunk_size)
        if reach > longest:
            msg += f" With top-k sparse attention (--sparse-budget 64) {reach:,} tokens would fit."
    trainable = plan_args.get("trainable_params")
    if trainable is None or trainable == plan_args.get("n_params"):  # full-parameter gradients
        msg += " LoRA (--lora-rank 16) drops the gradients and optimizer state of the base weights."
        smaller = []  # what halves a full-parameter step's per-weight state, each alone
        if least.param_grad_dtype is not None:
            smaller.append(("gradient sums in the weights' dtype (--param-grad-dtype param)",
                            least.replace(param_grad_dtype=None), plan_args))
        if plan_args.get("optimizer_bytes_per_param") is None or plan_args["optimizer_bytes_per_param"] > 3:
            smaller.append(("8-bit AdamW (--optimizer adamw8bit)", least,
                            {**plan_args, "optimizer_bytes_per_param": 2}))  # a byte per moment (block scales aside)
        for words, engine, args in smaller:
            reach = longest_context(lambda n: fit(engine, n, args).fits, least.chunk_size)
            if reach > longest:
                msg += f" With {words} {reach:,} tokens would fit."
    return msg + ("" if gpu_bound else " More host memory holds more pages (offload 'auto' puts what the GPU "
                                       "cannot hold there).")


def judge(model_config, seq_len: int, batch: int, engine: EngineConfig, machine: Machine,
          plan_args: dict) -> tuple[MemoryPlan, Fit]:
    """A setting's plan, and where its bytes go on `machine`. Kept attention outputs kept only as
    far as they fit (keep_attention None: the engine keeps them in the room the pages leave) are
    left out of the fit, so they never make a setting fail; a CPU run's pages are all in its one
    memory."""
    p = plan(model_config, seq_len, batch=batch, engine=engine, **plan_args)
    fitted = p
    if engine.keep_attention is None and p.kept_attention:
        fitted = plan(model_config, seq_len, batch=batch, engine=engine.replace(keep_attention=False), **plan_args)
    offload = engine.offload if machine.cuda else "none"
    return p, place(fitted, offload, machine.gpu_bytes, machine.host_bytes)
