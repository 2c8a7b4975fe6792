"""Memory math of a chunk-recurrent step, before any of it is allocated.

`plan()` is what `oomb plan` prints and what the benchmarks compare with what they measure.
All figures are bytes; the activation figure is an estimate (saved tensors of one chunk's
recompute), the rest are exact sizes of buffers oomb allocates.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from . import placement
from .config import EngineConfig
from .loss import SLICE_LOGIT_BYTES
from .memory.spec import KVShape, index_dtype
from .models import adapter_class
from .models.base import head_dim_of
from .placement import human_bytes  # noqa: F401 (oomb.plan.human_bytes)


@dataclass
class MemoryPlan:
    seq_len: int
    batch: int
    weights: int
    grads: int
    optimizer: int
    kv_pages: int  # K/V of every stored page (all chunks but the last), all layers
    grad_pages: int  # their dK/dV accumulators
    chunk_activations: int  # estimate: one chunk's recompute under autograd
    logits_slice: int  # one slice of fp32 logits and what its loss's backward makes of them
    layer_grads: int = 0  # estimate: the gradients one layer's backward makes for one chunk, beside what it saved
    head_logit_grads: int = 0  # a trainable head: the chunk's logit gradients (weight dtype), for its one GEMM
    embedding_grad: int = 0  # the embedding backward's dense (vocab, hidden) gradient, before it is added
    page_bytes: int = 0  # one page of one layer (K, V, dK, dV)
    masters: int = 0  # master_weights: an fp32 copy of every trainable parameter, which the optimizer steps
    full_layers: int = 0  # layers whose pages may go to the host (full attention)
    window_pages: int = 0  # bytes of the sliding-window layers' pages (a few per chunk; always on the GPU)
    representatives: int = 0  # sparse: a vector (or two) per page and KV head of the full layers; go with the pages
    selections: int = 0  # sparse: each chunk's kept page choices, every full layer (on the GPU)
    kept_attention: int = 0  # keep_attention: stage 1's attention outputs and LSEs (GPU or host: place())
    kept_layers: int = 0  # the layers they are of (every layer but the last); they are placed a layer at a time
    staged_pages: int = 1024  # pages of a staging buffer (two, with host layers): a dense group, a sparse selection
    # (a layer's pages, when fewer)
    staging: int = 0  # device bytes a step with host layers stages them in (memory/spec.py KVShape.staging_bytes)

    @property
    def working_set(self) -> int:
        """Device bytes one chunk's compute needs beside weights, gradients and pages."""
        return (self.chunk_activations + self.layer_grads + self.logits_slice + self.head_logit_grads
                + self.embedding_grad)

    @property
    def pages(self) -> int:
        return self.kv_pages + self.grad_pages

    @property
    def beside_pages(self) -> int:
        """Device bytes the step needs whatever the pages' placement: weights, gradients,
        optimizer state (and fp32 master weights), one chunk's working set and the sparse selections."""
        return self.weights + self.masters + self.grads + self.optimizer + self.working_set + self.selections

    @property
    def layer_bytes(self) -> int:
        """One full-attention layer's pages and representatives (a layer is placed whole)."""
        return (self.pages + self.representatives - self.window_pages) // max(1, self.full_layers)

    @property
    def kept_layer_bytes(self) -> int:
        """One layer's kept attention outputs (when counted: keep_attention)."""
        return self.kept_attention // self.kept_layers if self.kept_layers else 0

    @property
    def total(self) -> int:
        return self.beside_pages + self.pages + self.representatives + self.kept_attention

    def bytes_per_token(self) -> float:
        """Page bytes per token of context (the slope of memory against context length)."""
        return self.pages / max(1, self.batch * self.seq_len)

    def as_dict(self) -> dict:
        return {**asdict(self), "pages": self.pages, "total": self.total}


def plan(config, seq_len: int, batch: int = 1, engine: EngineConfig | None = None,
         dtype: torch.dtype = torch.bfloat16, trainable_params: int | None = None,
         optimizer_bytes_per_param: int | None = None, n_params: int | None = None, optimizer_shards: int = 1,
         tp: int = 1, master_weights: bool = False, **options) -> MemoryPlan:
    """Bytes a step needs for a transformers `config` (all on the GPU: offload 'none'), for an
    engine made with `engine` (an EngineConfig; or its fields as keyword arguments: chunk_size,
    page_size, kv_grad_dtype, sparse, checkpoint_layers, param_grad_dtype, keep_attention (True:
    every layer's outputs are counted), group_pages, compile_layers).

    trainable_params: parameters with gradients (default: all). optimizer_bytes_per_param:
    default torch's AdamW, two moments in the parameters' dtype (4 B for bf16, as the trainer
    makes it; 8 B with master_weights, the moments of the fp32 masters); 0 for none. n_params:
    the model's parameter count (default: counted on a meta-device instance of the config, so
    mixtures of experts are counted right).
    optimizer_shards: data-parallel ranks sharing the optimizer state (ZeRO-1: each keeps 1/n).
    master_weights: an fp32 master of every trainable parameter beside the weights (4 B each,
    oomb.train.master).
    tp: tensor-parallel degree: the plan is one rank's, which holds 1/tp of every layer's attention
    heads, KV heads (and their pages) and MLP columns, and the embeddings, head and norms whole
    (oomb.parallel.apply_tensor_parallel). n_params and trainable_params are then this rank's.
    compile_layers saves less for backward (dense MLPs; a mixture of experts is counted as eager,
    not having been measured).
    """
    engine = EngineConfig(**options) if engine is None else engine.replace(**options)
    chunk_size, sparse = engine.chunk_size, engine.sparse
    checkpoint_layers, compiled = engine.checkpoint_layers, engine.compile_layers
    keep_attention, param_grad_dtype = engine.keep_attention is not False, engine.param_grad_dtype
    # an expert's width (Qwen3-MoE names it apart from its dense MLP's)
    hidden, inter = config.hidden_size, getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    n_layers, vocab = config.num_hidden_layers, config.vocab_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = head_dim_of(config)
    item = torch.empty((), dtype=dtype).element_size()
    experts = getattr(config, "num_experts_per_tok", 0)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or heads % tp or kv_heads % tp:
        raise ValueError(f"tp={tp!r} must be a degree that divides num_attention_heads={heads} and "
                         f"num_key_value_heads={kv_heads}")
    family = adapter_class(config)
    if tp > 1 and family.tp_refusal:
        raise ValueError(f"tp={tp}: tensor parallelism is not implemented for {family.model_classes[0]} "
                         f"({family.tp_refusal}); use data parallelism")
    if n_params is None:
        total, split = count_params(config, split=True)
        n_params = total - split + split // tp  # this rank's
    heads, kv_heads, inter = heads // tp, kv_heads // tp, inter // tp  # this rank's share of every layer
    trainable = n_params if trainable_params is None else trainable_params
    if optimizer_bytes_per_param is None:
        # exp_avg and exp_avg_sq, each like the parameter the optimizer steps (an fp32 master, or the weight)
        optimizer_bytes_per_param = 2 * (4 if master_weights else item)
    shape = KVShape.from_config(config, engine, dtype, tp)  # the engine's page sizes and layer kinds
    spec = shape.page
    n_chunks = -(-seq_len // chunk_size)
    stored_chunks = n_chunks - 1  # the last chunk is never stored
    stored_pages = stored_chunks * shape.chunk_pages
    # Pages all layers store, per sequence: a sliding-window layer only those of a chunk that a later
    # window reaches (the engine's tails).
    all_pages = stored_chunks * sum(shape.kept_pages(i, shape.chunk_pages) for i in range(n_layers))
    tokens = batch * min(chunk_size, seq_len)
    # Saved for backward per token and layer: norm inputs/outputs, q/k/v/o, attention output,
    # MLP gate/up/act inputs (bf16), plus the fp32 RMSNorm intermediates.
    if experts:  # each routed copy of a token saves its expert's gate_up (2), clamped gate and up,
        # sigmoid, glu, up + 1, gated output (inter each) and output (hidden): GPT-OSS's experts
        mlp = experts * (7 * inter + hidden)
    else:
        mlp = 4 * inter
    # A layer's backward holds, beside what its forward saved, the gradients it makes: the MLP's
    # (its output's input, gate and up: 3 x intermediate a routed copy), q/k/v's and the residual
    # stream's. Left out, a LoRA step at chunk 8192 with its layers recomputed ran out of a 24 GiB
    # cap with 2.3 GiB more allocated than planned (H200, 2026-12-03, 553a0ae).
    layer_grads = item * (3 * inter * max(1, experts) + (heads + 2 * kv_heads) * head_dim + 2 * hidden)
    # The loss of a slice: with a trainable plain head, the fused ce_and_grad makes the logits'
    # gradient from the fp32 logits (2 slices, compiled); otherwise autograd through
    # F.cross_entropy keeps the log-probabilities and makes their gradient and the logits' (4).
    fused_loss = compiled and trainable_params is None and tp == 1  # the engine fuses it off TP only
    norms = 4 * 2 * hidden  # fp32
    if compiled and not experts:
        # Compiled, the SwiGLU saves its gate and up (its product is recomputed) and the RMSNorms
        # no fp32 intermediates: measured on the H200, 172 KiB a token and layer at the 7B shape
        # against this 171 KiB (the eager formula's 236; H200, 2026-12-01, 88a73cb).
        mlp, norms = 3 * inter, 0
    per_token_layer = item * (6 * hidden + mlp + 2 * (heads + 2 * kv_heads) * head_dim) + norms
    return MemoryPlan(
        seq_len=seq_len, batch=batch,
        weights=n_params * item,
        grads=trainable * max(item, torch.finfo(param_grad_dtype).bits // 8 if param_grad_dtype else 0),
        optimizer=-(-trainable * optimizer_bytes_per_param // optimizer_shards),
        masters=trainable * 4 if master_weights else 0,
        kv_pages=all_pages * batch * spec.kv_bytes,
        grad_pages=all_pages * batch * spec.grad_bytes,
        # checkpoint_layers: one layer's activations, plus every layer's input (the checkpoints)
        chunk_activations=tokens * (per_token_layer + n_layers * hidden * item if checkpoint_layers
                                    else n_layers * per_token_layer),
        layer_grads=tokens * layer_grads,
        logits_slice=(2 if fused_loss else 4) * min(SLICE_LOGIT_BYTES, tokens * vocab * 4),
        head_logit_grads=tokens * vocab * item if trainable_params is None else 0,
        embedding_grad=vocab * hidden * item if trainable_params is None else 0,
        page_bytes=spec.page_bytes,
        full_layers=len(shape.full_layers),
        window_pages=shape.window_bytes(batch, stored_chunks),
        kept_attention=shape.kept_attention_bytes(stored_chunks, n_layers - 1, batch) if keep_attention else 0,
        kept_layers=n_layers - 1 if keep_attention else 0,
        staged_pages=shape.staged_slots(stored_pages),
        staging=shape.staging_bytes(batch, stored_pages),
        **_sparse_bytes(sparse, shape, seq_len, batch, n_chunks),
    )


def _sparse_bytes(sparse, shape: KVShape, seq_len: int, batch: int, n_chunks: int) -> dict:
    """Representatives of every stored page, and each chunk's selection (memory/spec.Selection:
    int32 candidates, per-block picks in index_dtype; their counts as attention/policy.py states
    them)."""
    if sparse is None:
        return {}
    chunk_size, chunk_pages, kv_heads = shape.chunk_size, shape.chunk_pages, shape.page.n_kv_heads
    reps = (n_chunks - 1) * chunk_pages * batch * shape.rep_bytes
    chosen = 0
    for c in range(n_chunks):
        earlier = c * chunk_pages
        cand, keep = min(sparse.chunk_budget, earlier), min(sparse.budget, earlier)
        if keep == 0:
            continue
        index = index_dtype(cand).itemsize
        blocks = -(-(min(seq_len, (c + 1) * chunk_size) - c * chunk_size) // sparse.block_queries)
        chosen += batch * (4 * cand + kv_heads * blocks * keep * index)
    # Representatives: every full layer's store keeps them; selections: only those that select (not
    # the policy's dense layers, which attend to every page)
    selecting = set(shape.full_layers) - sparse.dense_set(len(shape.windows))
    return {"representatives": len(shape.full_layers) * reps, "selections": len(selecting) * chosen}


#: the projections tensor parallelism splits (oomb.parallel.apply_tensor_parallel)
TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def count_params(config, split: bool = False):
    """Parameters of the model a transformers config describes (built on the meta device); with
    `split`, (all, those of the projections tensor parallelism splits)."""
    total, tp_split = _count_params_json(config.to_json_string())
    return (total, tp_split) if split else total


@lru_cache(maxsize=16)
def _count_params_json(config_json: str) -> tuple[int, int]:
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from .models.quiet import import_model_code

    data = json.loads(config_json)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    import_model_code()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())
    split = sum(p.numel() for name, p in params.items() if name.split(".")[-2] in TP_SPLIT)
    return sum(p.numel() for p in params.values()), split


def lora_params(config, rank: int, tp: int = 1, targets: tuple[str, ...] | None = None) -> int:
    """Trainable parameters of LoRA rank `rank` on `targets` (None: the modules `oomb train
    --lora-rank` adapts, the family's lora_targets), on one rank of tensor-parallel degree `tp`: a
    column-parallel projection's B is split with it, a row-parallel one's A (oomb.parallel); the
    other factor is whole on every rank."""
    hidden, head_dim = config.hidden_size, head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    shapes = {"q_proj": (hidden, q, True), "k_proj": (hidden, kv, True), "v_proj": (hidden, kv, True),
              "o_proj": (q, hidden, False), "gate_proj": (hidden, inter, True), "up_proj": (hidden, inter, True),
              "down_proj": (inter, hidden, False), "qkv_proj": (hidden, q + 2 * kv, True),
              "gate_up_proj": (hidden, 2 * inter, True)}  # (in, out, column-parallel)
    per_layer = 0
    for name in targets or adapter_class(config).lora_targets:
        n_in, n_out, column = shapes[name]
        per_layer += rank * (n_in + n_out // tp if column else n_in // tp + n_out)
    return config.num_hidden_layers * per_layer


@dataclass
class Fit:
    """Where a step's bytes go under an offload mode, against the memory a machine has."""

    offload: str
    gpu: int  # device bytes the step needs (weights, grads, optimizer, working set, device pages)
    host: int  # pinned host bytes (the host layers' pages, kept attention outputs that go there)
    gpu_capacity: int
    host_capacity: int
    decision: placement.Placement | None = None

    @property
    def fits(self) -> bool:
        return self.gpu <= self.gpu_capacity and self.host <= self.host_capacity

    def summary(self) -> str:
        """The verdict against the machine (the totals are the table's)."""
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"offload {self.offload}: {verdict} (GPU {human_bytes(self.gpu_capacity)}, "
                f"host {human_bytes(self.host_capacity)})")

    def table(self, p: MemoryPlan) -> str:
        """The plan's bytes by kind, each where this placement puts it (GPU, pinned host memory),
        the headroom left free on the GPU, and one total for each."""
        d = self.decision
        full = max(1, p.full_layers)
        window_kv = p.window_pages * p.kv_pages // max(1, p.pages)  # window pages split as every page is

        def split(n: int, window: int = 0) -> tuple[int, int]:
            """A page kind's bytes: the window layers' and the device layers' on the GPU, the rest on the host."""
            host = (n - window) * d.host_layers // full
            return n - host, host
        per_kept = p.kept_layer_bytes
        rows = [("weights", p.weights, 0), *([("fp32 master weights", p.masters, 0)] if p.masters else []),
                ("gradients", p.grads, 0), ("optimizer state", p.optimizer, 0),
                ("K/V pages", *split(p.kv_pages, window_kv)),
                ("dK/dV pages", *split(p.grad_pages, p.window_pages - window_kv))]
        if p.representatives or p.selections:
            rows += [("sparse page representatives", *split(p.representatives)), ("sparse selections", p.selections, 0)]
        if d.staging:
            rows.append(("staging buffers for host pages", d.staging, 0))
        if p.kept_attention:
            rows.append(("kept attention outputs", d.kept_gpu * per_kept, d.kept_host * per_kept))
        rows += [("one chunk's activations (est.)", p.chunk_activations, 0),
                 ("one layer's backward (est.)", p.layer_grads, 0), ("logits slice + grad", p.logits_slice, 0),
                 ("head's logit gradients", p.head_logit_grads, 0),
                 ("embedding gradient (transient)", p.embedding_grad, 0),
                 (f"headroom left free ({100 * GPU_MARGIN_FRACTION:g} % of the GPU, >= "
                  f"{GPU_MARGIN_BYTES / 2**30:g} GiB)", gpu_margin(self.gpu_capacity), 0)]
        width = max(len(r[0]) for r in rows)

        def gib(n: int, blank: bool) -> str:
            return " " * 13 if blank else f"{n / 2**30:9.2f} GiB"
        lines = [f"{'':<{width}}  {'GPU':>13}  {'host':>13}"]
        lines += [f"{name:<{width}}  {gib(gpu, False)}  {gib(host, not host)}".rstrip() for name, gpu, host in rows]
        lines.append(f"{'total':<{width}}  {gib(self.gpu, False)}  {gib(self.host, False)}")
        return "\n".join(lines)


#: device bytes left free beside everything planned (allocator slack, kernels, CUDA context): at
#: least this, and `GPU_MARGIN_FRACTION` of the device, so that a planned step peaks at <= 95 % of it
GPU_MARGIN_BYTES = 2 * 2**30
GPU_MARGIN_FRACTION = 0.05


def gpu_margin(capacity: int) -> int:
    """Device bytes a plan leaves free on a GPU of `capacity` bytes (0: unknown, the floor)."""
    return max(GPU_MARGIN_BYTES, int(capacity * GPU_MARGIN_FRACTION))


def place(p: MemoryPlan, offload: str, gpu_capacity: int, host_capacity: int) -> Fit:
    """The step's placement (placement.place(), as the engine decides it) on a GPU of
    `gpu_capacity` bytes beside weights, gradients, optimizer state, one chunk's working set and
    a margin (gpu_margin()); kept attention outputs as many layers' on the GPU as fit, the others on the host."""
    fixed = p.beside_pages + gpu_margin(gpu_capacity)
    per_kept = p.kept_layer_bytes
    decision = placement.place(placement.PlacementInput(
        offload=offload, full_layers=p.full_layers,
        layer_bytes=p.layer_bytes,
        window_bytes=p.window_pages, staging_bytes=p.staging, gpu_room=gpu_capacity - fixed,
        kept_layers=p.kept_layers, kept_gpu_bytes=per_kept, kept_host_bytes=per_kept))
    return Fit(offload, fixed + decision.gpu_bytes, decision.host_bytes, gpu_capacity, host_capacity, decision)


def longest_context(fits, chunk_size: int, limit: int = 2**26) -> int:
    """The longest seq_len (a multiple of chunk_size, up to `limit`) with fits(seq_len) true; 0 if none."""
    lo, hi = 0, limit // chunk_size  # in chunks; fits() is monotone in the length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * chunk_size):
            lo = mid
        else:
            hi = mid - 1
    return lo * chunk_size
