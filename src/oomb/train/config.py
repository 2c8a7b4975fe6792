"""Trainer settings: one plain dataclass, defaults that run the embedded demo on a CPU."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..models.float8 import RECIPES as FLOAT8_RECIPES
from ..models.rope import RopeScaling
from .data import BIN_DTYPES, check_token_suffix
from .needles import DEFAULT_TEMPLATE

OPTIMIZERS = ("adamw", "adamw8bit")
LR_SCHEDULES = ("cosine", "constant")

#: integer settings and their least value ('auto' chunk_size aside)
INT_FIELDS = {"seq_len": 2, "batch": 1, "grad_accum": 1, "steps": 1, "warmup_steps": 0, "chunk_size": 1,
              "page_size": 1, "group_pages": 1, "sparse_budget": 0, "sparse_chunk_budget": 0, "sparse_sink_pages": 0,
              "needles_per_sequence": 1, "loss_last": 0, "tp": 1, "lora_rank": 0, "save_every": 0, "log_every": 1,
              "max_bad_steps": 1, "eval_every": 0, "eval_batches": 1, "seed": 0, "save_total_limit": 0,
              "recall_pairs": 0, "recall_keys": 2, "recall_values": 2}
#: real-valued settings: (least value, whether it is excluded, what the value means); None stays unset for the
#: optional ones (rope_theta, kept_host_gib)
FLOAT_FIELDS = {
    "lr": (0.0, True, "the peak learning rate, e.g. 3e-4"),
    "weight_decay": (0.0, False, "AdamW's decoupled weight decay, e.g. 0.1 (0: none)"),
    "grad_clip": (0.0, False, "the largest gradient norm, e.g. 1.0 (0: no clipping, the norm still logged)"),
    "needle_rate": (0.0, False, "the share of sequences with needles, at most 1"),
    "lora_alpha": (0.0, True, "LoRA's scale numerator (the adapters are scaled by lora_alpha / lora_rank), e.g. 16"),
    "rope_theta": (0.0, True, "the new RoPE base, e.g. 8x the model's"),
    "kept_host_gib": (0.0, False, "0 keeps attention outputs on the GPU only; leave it unset for half the free "
                                  "host memory"),
}


@dataclass
class TrainConfig:
    model: str = "tiny"  # a preset name (oomb.presets) or a local transformers checkpoint
    data: str = "copy"  # 'copy' (built-in long-context task), a .npy token file (oomb tokenize) or a .bin file
    data_dtype: str = "uint16"  # of a .bin file's ids: uint16 | uint32 (vocabularies above 65,536) | int32
    # a document file (oomb tokenize: .docs.npy beside the ids): True packs whole documents into each sequence
    # (position_ids restart at each), False takes one document per sequence; None: packed for chat data (a
    # .mask.npy), windows of the token stream for text
    pack: bool | None = None
    drop_long: bool = False  # documents longer than seq_len are left out (default: cut to seq_len, one warning)
    seq_len: int = 1024
    batch: int = 1  # sequences per micro-batch (per data-parallel rank)
    grad_accum: int = 1  # micro-batches per optimizer step (gradients summed, loss normalised over all of them)
    steps: int = 400
    lr: float = 5e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    # after the warm-up: cosine (decay to 10 % of the peak by the last step) | constant (the peak throughout)
    lr_schedule: str = "cosine"
    grad_clip: float = 1.0
    # 'auto' (chunk_size, kv_grad_dtype; None for checkpoint_layers): oomb.auto.choose() picks the fastest
    # setting the memory plan says fits this machine's GPU and host memory; a value given wins
    chunk_size: int | str = "auto"
    page_size: int = 128
    # pages per attention call (and per dense host layer's transfer; every offload mode groups alike, so their
    # gradients are bitwise equal): 1024 is faster than 128 for dense attention, offloaded or not
    group_pages: int = 1024
    backend: str = "auto"  # auto | torch | triton
    # auto (whole layers' pages on the GPU while they fit, the rest on the host: 'none' when all fit) | none |
    # all (pages on the host: least GPU memory)
    offload: str = "auto"
    kv_grad_dtype: str = "auto"  # auto | float32 | bfloat16 (halves the dK/dV pages)
    # stage 2 takes stage 1's attention outputs instead of computing them again (C x H x (D + 2) x 2
    # bytes per layer and chunk: 28 MiB at Qwen2.5-7B's chunk 4096), on the GPU when they fit beside
    # the pages, else in pinned host memory; None: as many layers as fit (decided by the engine at
    # each step), True: all of them or an error
    keep_attention: bool | None = None
    kept_host_gib: float | None = None  # host memory the kept outputs may pin (default: half of what is free)
    # recompute each layer in backward: least activation memory, ~+25 % compute; None: auto
    checkpoint_layers: bool | None = None
    sparse_budget: int = 0  # > 0: top-k sparse attention, this many earlier pages per query block (oomb.TopKPages)
    sparse_chunk_budget: int = 0  # pages one chunk's blocks choose from (and offload moves); 0: max(256, budget)
    sparse_sink_pages: int = 1  # the first pages every query block attends
    sparse_representative: str = "mean"  # mean | minmax: how a page is scored against a query block
    sparse_dense_layers: str = ""  # layers that attend densely among the top-k ones, e.g. "-2,-1" (the last two)
    # context extension (models/rope.py): a new RoPE base, and/or TYPE:FACTOR scaling (linear, dynamic, yarn,
    # llama3), written into the model config's rope_parameters and kept in the exported checkpoint
    rope_theta: float | None = None
    rope_scaling: str = ""
    # key-value needles (train/needles.py) in a share of the training sequences, so retrieval is learnable
    needle_rate: float = 0.0
    needles_per_sequence: int = 4
    needle_template: str = DEFAULT_TEMPLATE
    # associative recall (train/recall.py): this many single-token key-value pairs in every sequence, keys and
    # values from ids reserved at the top of the vocabulary (the text must not use them; preset byte-kv-30m)
    recall_pairs: int = 0
    recall_keys: int = 256  # distinct key ids
    recall_values: int = 256  # distinct value ids (chance: 1 / recall_values)
    recall_first_id: int | None = None  # the first key id (values follow the keys); None: the top of the vocabulary
    tokenizer: str = ""  # encodes needles: 'bytes' (byte-level models) or a checkpoint; default: the model's own
    loss_last: int = 0  # > 0: only the last this many tokens of each sequence carry loss (a long prompt, then the answer)
    liger: bool = False  # Liger's Triton RMSNorm and SwiGLU in the model (CUDA, pip install liger-kernel)
    # none | tensorwise | rowwise: the decoder layers' projections as torchao float8 GEMMs (SM 8.9+ GPUs),
    # scaled per chunk by that recipe (oomb.models.float8)
    float8: str = "none"
    # torch.compile the layer pieces around attention (fused norms, RoPE, MLP); None: on under tensor
    # parallelism (tp > 1), where DTensor's per-op dispatch otherwise leaves the GPU waiting on the host,
    # with float8, whose casts to float8 then fuse into those pieces, and on CUDA for the dense families
    # with full-parameter gradients (oomb.auto.compiles)
    compile: bool | None = None
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    tp: int = 1  # tensor-parallel degree (under torchrun; the other factor of the world size is data parallel)
    # seconds a collective waits for the other ranks before the run fails (a rank died or hangs); more than the
    # longest a checkpoint takes to write (rank 0 writes the model while the others wait)
    process_group_timeout: float = 600.0
    # adamw: torch's (moments in the weights' dtype); adamw8bit: torchao's AdamW8bit, 8-bit moments (2 B per
    # parameter) and bf16 weights stochastically rounded, so updates below half a bf16 step are kept on average
    optimizer: str = "adamw"
    # float32: the engine sums each parameter's chunk gradients in fp32 (bf16 weights: 4 B per trainable
    # parameter during the step instead of 2; gradients as one full-sequence backward gives them); param: in
    # the weights' dtype (bf16 sums: ~1e-2 relative error at 64 chunks, growing with their number)
    param_grad_dtype: str = "float32"
    shard_optimizer: bool = True  # data parallel with tp=1: each rank keeps 1/dp of AdamW's state (ZeRO-1)
    lora_rank: int = 0  # > 0: train LoRA adapters on attention and MLP projections only
    lora_alpha: float = 16.0
    # where checkpoints, metrics.jsonl and the final model go (one run at a time: a lock); empty: nothing is
    # written. A directory holding a previous run's files is refused unless the run resumes or overwrites it
    output_dir: str = ""
    overwrite: bool = False  # delete the previous run's metrics.jsonl, step-* and final in output_dir first
    save_every: int = 0  # steps between checkpoints (0: only at the end, if output_dir is set)
    save_total_limit: int = 0  # > 0: keep this many step-* checkpoints, the oldest deleted once a new one is verified
    save: bool = True  # False: no checkpoints and no final model, only metrics.jsonl (a benchmark's run)
    # a checkpoint directory written by this trainer; 'latest': the newest verified one in output_dir;
    # 'auto': that, or step 0 when there is none
    resume: str = ""
    # seconds from SIGTERM/SIGINT in which the run stops at a chunk boundary and writes its checkpoint, else exits
    # without it (torchrun sends SIGKILL 30 s after it forwards SIGTERM); 0: no limit
    shutdown_timeout: float = 25.0
    log_every: int = 1
    max_bad_steps: int = 3  # non-finite loss or gradient norm this many steps in a row: stop (with a checkpoint)
    eval_every: int = 0  # > 0: held-out loss every this many steps and at the end
    eval_data: str = ""  # its source (as --data); empty: the training source with another seed
    eval_batches: int = 1  # batches of the held-out set (the same ones at every evaluation)
    seed: int = 0

    @property
    def saves(self) -> bool:
        """Checkpoints and the final model are written (into output_dir)."""
        return bool(self.output_dir) and self.save

    @property
    def compile_layers(self) -> bool:
        """Compiled layers whatever the device (the trainer adds oomb.auto.compiles()'s rule)."""
        return self.tp > 1 or self.float8 != "none" if self.compile is None else self.compile

    @property
    def auto_fields(self) -> tuple[str, ...]:
        """The engine settings left to oomb.auto.choose()."""
        return tuple(name for name, auto in (("chunk_size", self.chunk_size == "auto"),
                                             ("kv_grad_dtype", self.kv_grad_dtype == "auto"),
                                             ("checkpoint_layers", self.checkpoint_layers is None)) if auto)

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, str) and self.chunk_size != "auto":
            if not self.chunk_size.isdigit():
                raise ValueError(f"chunk_size={self.chunk_size!r} must be 'auto' or a number of tokens (e.g. 4096)")
            self.chunk_size = int(self.chunk_size)
        for name, low in INT_FIELDS.items():
            value = getattr(self, name)
            if name == "chunk_size" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be a whole number >= {low}")
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        if self.seed >= 2**63:
            raise ValueError(f"seed={self.seed} must be < 2**63 (torch's and numpy's generators take 64-bit seeds)")
        for name, (low, strict, fix) in FLOAT_FIELDS.items():
            value = getattr(self, name)
            if value is None and name in ("rope_theta", "kept_host_gib"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low or (strict and value == low):
                raise ValueError(f"{name}={value!r} must be {'>' if strict else '>='} {low:g} and finite: {fix}")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"weight_decay={self.weight_decay:g} with lr={self.lr:g}: AdamW multiplies every weight by "
                             f"1 - lr x weight_decay = {1 - self.lr * self.weight_decay:g} each step, which must stay "
                             "above 0; lower --weight-decay (typical: 0.1)")
        if self.sparse_budget and 0 < self.sparse_chunk_budget < self.sparse_budget:
            raise ValueError(f"sparse_chunk_budget={self.sparse_chunk_budget} must be >= sparse_budget="
                             f"{self.sparse_budget}")
        if self.needle_rate > 1:
            raise ValueError(f"needle_rate={self.needle_rate} must be between 0 and 1 (the share of sequences with "
                             "needles)")
        if self.recall_pairs and self.needle_rate:
            raise ValueError(f"recall_pairs={self.recall_pairs} and needle_rate={self.needle_rate}: a run trains one "
                             "retrieval task; drop one of them")
        if self.recall_pairs and self.data == "copy":
            raise ValueError(f"recall_pairs={self.recall_pairs} puts recall pairs into text; the copy task has none: "
                             "pass --data with a token file (oomb corpus writes one)")
        if self.recall_pairs and 4 * self.recall_pairs > self.seq_len // 2:
            raise ValueError(f"recall_pairs={self.recall_pairs} take {4 * self.recall_pairs} tokens, more than half "
                             f"of seq_len={self.seq_len}: use fewer pairs")
        if self.loss_last >= self.seq_len:
            raise ValueError(f"loss_last={self.loss_last} must be >= 0 and < seq_len={self.seq_len} (0: every token "
                             "carries loss)")
        if self.rope_scaling:
            RopeScaling.parse(self.rope_scaling)  # its form and factor, before anything is built
        check_token_suffix(self.data, "--data")
        if self.eval_data:
            check_token_suffix(self.eval_data, "--eval-data")
        self.needle_template = self.needle_template.replace("\\n", "\n")  # as typed on a command line
        if not 0 <= self.shutdown_timeout < math.inf:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} must be a number of seconds >= 0 (0: no limit)")
        if not 0 < self.process_group_timeout < math.inf:
            raise ValueError(f"process_group_timeout={self.process_group_timeout} must be a number of seconds > 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} must be one of {', '.join(LR_SCHEDULES)}")
        if self.kv_grad_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_grad_dtype={self.kv_grad_dtype!r} must be auto, float32 or bfloat16")
        if self.offload not in ("auto", "none", "all"):
            raise ValueError(f"offload={self.offload!r} must be auto, none or all")
        if self.liger and self.tp > 1:
            raise ValueError(f"liger=True with tp={self.tp}: Liger's kernels take no tensor-parallel (DTensor) "
                             "inputs; train with tp=1 or without liger")
        if self.float8 not in ("none", *FLOAT8_RECIPES):
            raise ValueError(f"float8={self.float8!r} must be none, {' or '.join(FLOAT8_RECIPES)}")
        if self.float8 != "none" and self.tp > 1:
            raise ValueError(f"float8={self.float8!r} with tp={self.tp}: oomb's tensor-parallel plan splits plain "
                             "Linear layers, not float8 ones; train with tp=1 or float8='none'")
        if self.data_dtype not in BIN_DTYPES:
            raise ValueError(f"data_dtype={self.data_dtype!r} must be one of {BIN_DTYPES}")
        if self.param_grad_dtype not in ("float32", "param"):
            raise ValueError(f"param_grad_dtype={self.param_grad_dtype!r} must be float32 or param")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")
        if self.optimizer == "adamw8bit" and self.tp > 1:  # torchao 0.18: its 8-bit state fails inside DTensor
            raise ValueError(f"optimizer='adamw8bit' with tp={self.tp}: torchao's 8-bit state does not run on "
                             "tensor-parallel (DTensor) weights; use --optimizer adamw with --tp, or --tp 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be auto, float32 or bfloat16")

