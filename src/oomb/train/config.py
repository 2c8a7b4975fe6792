"""Trainer settings: one plain dataclass, defaults that run the embedded demo on a CPU.

Each field is declared once, with its description (and its fixed choices) in the field's
metadata: `oomb train | plan | eval` build their flags from it (oomb.flags), `--config FILE.yaml`
is checked against it, and a run writes every field, as it used them, to its output directory's
config.yaml (oomb.train.trainer.resolved_config)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from ..attention import BACKENDS
from ..attention.policy import check_policy_name
from ..attention.sparse import REPRESENTATIVES
from ..data.needles import DEFAULT_TEMPLATE
from ..data.tokens import BIN_DTYPES, check_token_suffix
from ..models.float8 import RECIPES as FLOAT8_RECIPES
from ..models.rope import RopeScaling
from ..placement import OFFLOAD_MODES
from .callbacks import tracker_names

OPTIMIZERS = ("adamw", "adamw8bit")
LR_SCHEDULES = ("cosine", "constant")
DTYPES = ("auto", "float32", "bfloat16")

#: integer settings and their least value ('auto' chunk_size aside; None stays unset for recall_first_id)
INT_FIELDS = {"seq_len": 2, "batch": 1, "grad_accum": 1, "steps": 1, "warmup_steps": 0, "chunk_size": 1,
              "page_size": 1, "group_pages": 1, "sparse_budget": 0, "sparse_chunk_budget": 0, "sparse_sink_pages": 0,
              "needles_per_sequence": 1, "loss_last": 0, "tp": 1, "lora_rank": 0, "save_every": 0, "log_every": 1,
              "max_bad_steps": 1, "eval_every": 0, "eval_batches": 1, "seed": 0, "save_total_limit": 0,
              "recall_pairs": 0, "recall_keys": 2, "recall_values": 2, "recall_first_id": 0}
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


def setting(default, help: str, choices: tuple[str, ...] = (), tokens: bool = False):
    """A TrainConfig field with what its flag shows: `help`, the fixed `choices` (checked by
    TrainConfig too), and tokens=True for a count of tokens typed as 64K or 1M."""
    metadata = {"help": help}
    if choices:
        metadata["choices"] = tuple(choices)
    if tokens:
        metadata["tokens"] = True
    return field(default=default, metadata=metadata)


def master_weights_refusal(master_weights: str, dtype: str, lora_rank: int, optimizer: str, tp: int) -> None:
    """Refuse (ValueError) fp32 master weights with settings they do not go with: oomb train's
    configuration and `oomb plan` (whose LoRA rank may be an adapter's) ask the same."""
    if master_weights == "none":
        return
    why = ("--dtype float32: the weights are already fp32" if dtype == "float32" else
           f"lora_rank={lora_rank}: LoRA's adapters are fp32 already" if lora_rank else
           "optimizer='adamw8bit': its stochastic rounding of bf16 weights is the other way to keep small "
           "updates; use --optimizer adamw" if optimizer == "adamw8bit" else
           f"tp={tp}: the masters are not built for tensor-parallel (DTensor) weights; use --tp 1" if tp > 1 else "")
    if why:
        raise ValueError(f"master_weights={master_weights!r} (fp32 copies of bf16 weights) with {why}")


@dataclass
class TrainConfig:
    # One line per setting: `name: type = setting(default, "what it does, and why", choices=(...))`. That line
    # is the whole of it: `oomb train --name` with this help and these choices, the key `name` of --config
    # files and of a run's config.yaml, and the choices checked below (oomb.flags builds the flags; `oomb
    # plan` / `oomb eval` take the fields cli.PLAN_FIELDS / EVAL_FIELDS name). A whole number or a real
    # number also goes into INT_FIELDS / FLOAT_FIELDS above (its least value: checked here and by the flag).
    model: str = setting("tiny", "a preset name (oomb.presets) or a local transformers checkpoint")
    data: str = setting("copy", "'copy' (the built-in long-context task), a .npy token file (oomb tokenize) or a "
                                ".bin file")
    data_dtype: str = setting("uint16", "of a .bin file's token ids (uint32: vocabularies above 65,536)",
                              choices=BIN_DTYPES)
    pack: bool | None = setting(None, "a document file (oomb tokenize: .docs.npy beside the ids): --pack packs "
                                      "whole documents into each sequence (position_ids restart at each), "
                                      "--no-pack takes one document per sequence; unset: packed for chat data (a "
                                      ".mask.npy), windows of the token stream for text")
    drop_long: bool = setting(False, "documents longer than seq_len are left out (default: cut to seq_len, one "
                                     "warning)")
    seq_len: int = setting(1024, "tokens in each sequence, e.g. 4096, 64K or 1M", tokens=True)
    batch: int = setting(1, "sequences per micro-batch (per data-parallel rank)")
    grad_accum: int = setting(1, "micro-batches per optimizer step (gradients summed, the loss normalised over "
                                 "all of them)")
    steps: int = setting(400, "optimizer steps")
    lr: float = setting(5e-3, "the peak learning rate")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay (0: none)")
    warmup_steps: int = setting(10, "steps of linear warm-up to the peak learning rate")
    lr_schedule: str = setting("cosine", "after the warm-up: cosine (decay to 10 % of the peak by the last step) "
                                         "or constant (the peak throughout)", choices=LR_SCHEDULES)
    grad_clip: float = setting(1.0, "the largest gradient norm (0: no clipping, the norm still logged)")
    chunk_size: int | str = setting("auto", "tokens per chunk (a multiple of page_size); auto: oomb.auto picks "
                                            "the fastest size the memory plan says fits this machine's GPU and "
                                            "host memory (a value given wins)")
    page_size: int = setting(128, "tokens per page of K/V")
    group_pages: int = setting(1024, "pages per attention call (and per dense host layer's transfer; every "
                                     "offload mode groups alike, so their gradients are bitwise equal): 1024 is "
                                     "faster than 128 for dense attention, offloaded or not")
    backend: str = setting("auto", "attention kernels: triton (CUDA), torch (plain PyTorch: CPU); auto: triton "
                                   "on CUDA, torch elsewhere", choices=BACKENDS)
    offload: str = setting("auto", "where K/V pages live: auto (whole layers' pages on the GPU while they fit, "
                                   "the rest on the host: 'none' when all fit), none (the GPU), all (the host: "
                                   "least GPU memory)", choices=OFFLOAD_MODES)
    kv_grad_dtype: str = setting("auto", "the dK/dV pages' dtype (bfloat16 halves their bytes); auto: oomb.auto "
                                         "picks it with chunk_size", choices=DTYPES)
    keep_attention: bool | None = setting(
        None, "stage 2 takes stage 1's attention outputs instead of computing them again (C x H x (D + 2) x 2 "
              "bytes per layer and chunk: 28 MiB at Qwen2.5-7B's chunk 4096), on the GPU when they fit beside the "
              "pages, else in pinned host memory; unset: as many layers as fit (the engine decides at each step), "
              "--keep-attention: all of them or an error")
    kept_host_gib: float | None = setting(None, "host memory (GiB) the kept attention outputs may pin (unset: half "
                                                "of what is free; 0: GPU only)")
    checkpoint_layers: bool | None = setting(None, "recompute each layer in backward: least activation memory, "
                                                   "~+25 % compute; unset: oomb.auto decides with chunk_size")
    sparse_budget: int = setting(0, "> 0: top-k sparse attention, this many earlier pages per query block "
                                    "(oomb.TopKPages)")
    sparse_policy: str = setting("topk", "the sparse attention --sparse-budget turns on: a policy registered with "
                                         "oomb.register_policy (topk: page-level top-k by each page's representative, "
                                         "oomb.TopKPages)")
    sparse_chunk_budget: int = setting(0, "pages one chunk's query blocks choose from (and offload moves); 0: "
                                          "max(256, sparse_budget)")
    sparse_sink_pages: int = setting(1, "the first pages every query block attends")
    sparse_representative: str = setting("mean", "how a page is scored against a query block",
                                         choices=REPRESENTATIVES)
    sparse_dense_layers: str = setting("", "layers that attend densely among the top-k ones, e.g. -2,-1 (the "
                                           "last two)")
    rope_theta: float | None = setting(None, "context extension (models/rope.py): a new RoPE base, written into "
                                             "the model config's rope_parameters and kept in the exported "
                                             "checkpoint")
    rope_scaling: str = setting("", "context extension: TYPE:FACTOR RoPE scaling, TYPE one of linear, dynamic, "
                                    "yarn, llama3 (kept in the exported checkpoint)")
    needle_rate: float = setting(0.0, "key-value needles (data/needles.py) in this share of the training "
                                      "sequences, so retrieval is learnable")
    needles_per_sequence: int = setting(4, "needles in a sequence that has them")
    needle_template: str = setting(DEFAULT_TEMPLATE, "the needle, with {key} then {value}; the query is its text "
                                                     "up to {value} (\\n: a newline)")
    recall_pairs: int = setting(0, "associative recall (data/recall.py): this many single-token key-value pairs "
                                   "in every sequence, keys and values from ids reserved at the top of the "
                                   "vocabulary (the text must not use them; preset byte-kv-30m)")
    recall_keys: int = setting(256, "distinct recall key ids")
    recall_values: int = setting(256, "distinct recall value ids (chance: 1 / recall_values)")
    recall_first_id: int | None = setting(None, "the first recall key id (the values follow the keys); unset: the "
                                                "top of the vocabulary")
    tokenizer: str = setting("", "encodes needles: 'bytes' (byte-level models) or a checkpoint; default: the "
                                 "model's own")
    loss_last: int = setting(0, "> 0: only the last this many tokens of each sequence carry loss (a long prompt, "
                                "then the answer)")
    liger: bool = setting(False, "Liger's Triton RMSNorm and SwiGLU in the model (CUDA, pip install liger-kernel)")
    float8: str = setting("none", "the decoder layers' projections as torchao float8 GEMMs (SM 8.9+ GPUs), "
                                  "scaled per chunk by this recipe (oomb.models.float8)",
                          choices=("none", *FLOAT8_RECIPES))
    compile: bool | None = setting(
        None, "torch.compile the layer pieces around attention (fused norms, RoPE, MLP); unset: on under tensor "
              "parallelism (tp > 1), where DTensor's per-op dispatch otherwise leaves the GPU waiting on the host, "
              "with float8, whose casts to float8 then fuse into those pieces, and on CUDA for the dense families "
              "with full-parameter gradients (oomb.auto.compiles)")
    dtype: str = setting("auto", "the weights' dtype; auto: bfloat16 on CUDA, float32 on CPU", choices=DTYPES)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N (auto: CUDA when there is one)")
    tp: int = setting(1, "tensor-parallel degree (under torchrun; the other factor of the world size is data "
                         "parallel)")
    process_group_timeout: float = setting(600.0, "seconds a collective waits for the other ranks before the run "
                                                  "fails (a rank died or hangs); more than the longest a "
                                                  "checkpoint takes to write (rank 0 writes the model while the "
                                                  "others wait)")
    optimizer: str = setting("adamw", "adamw: torch's (moments in the weights' dtype); adamw8bit: torchao's "
                                      "AdamW8bit, 8-bit moments (2 B per parameter) and bf16 weights "
                                      "stochastically rounded, so updates below half a bf16 step are kept on "
                                      "average", choices=OPTIMIZERS)
    param_grad_dtype: str = setting("float32", "float32: the engine sums each parameter's chunk gradients in fp32 "
                                               "(bf16 weights: 4 B per trainable parameter during the step instead "
                                               "of 2; gradients as one full-sequence backward gives them); param: "
                                               "in the weights' dtype (bf16 sums: ~1e-2 relative error at 64 "
                                               "chunks, growing with their number)", choices=("float32", "param"))
    master_weights: str = setting("none", "float32: the optimizer updates fp32 master copies of the bf16 trainable "
                                          "weights (its state fp32 too: 4 + 8 B per parameter beside the bf16 "
                                          "weights), and each step sets the weights to their masters rounded to "
                                          "nearest, so updates below half a bf16 step accumulate; the layers, "
                                          "kernels and pages still run in bf16. Needs --dtype bfloat16 (auto on "
                                          "CUDA), full-parameter training, --optimizer adamw, tp=1",
                                  choices=("none", "float32"))
    shard_optimizer: bool = setting(True, "data parallel with tp=1: each rank keeps 1/dp of AdamW's state (ZeRO-1)")
    lora_rank: int = setting(0, "> 0: train LoRA adapters of this rank on the attention and MLP projections only "
                                "(0: full-parameter training)")
    lora_alpha: float = setting(16.0, "LoRA's scale numerator (the adapters are scaled by lora_alpha / lora_rank)")
    output_dir: str = setting("", "where checkpoints, metrics.jsonl, config.yaml (the resolved settings) and the "
                                  "final model go (one run at a time: a lock); empty: nothing is written. A "
                                  "directory holding a previous run's files is refused unless the run resumes or "
                                  "overwrites it")
    overwrite: bool = setting(False, "delete the previous run's metrics.jsonl, step-*, final and tensorboard in "
                                               "output_dir first")
    save_every: int = setting(0, "steps between checkpoints (0: only at the end, if output_dir is set)")
    save_total_limit: int = setting(0, "> 0: keep this many step-* checkpoints, the oldest deleted once a new one "
                                       "is verified")
    save: bool = setting(True, "--no-save: no checkpoints and no final model, only metrics.jsonl (a benchmark's "
                               "run)")
    resume: str = setting("", "a checkpoint directory written by this trainer; latest: the newest verified one in "
                              "output_dir; auto: that, or step 0 when there is none")
    shutdown_timeout: float = setting(25.0, "seconds from SIGTERM/SIGINT in which the run stops at a chunk "
                                            "boundary and writes its checkpoint, else exits without it (torchrun "
                                            "sends SIGKILL 30 s after it forwards SIGTERM); 0: no limit")
    log_every: int = setting(1, "steps between log lines")
    report_to: str = setting("", "experiment trackers (rank 0), a comma list of tensorboard (event files in "
                                 "<output_dir>/tensorboard), wandb, mlflow, trackio: each gets every metrics.jsonl row "
                                 "and the resolved configuration; each is an extra (pip install 'oomb[wandb]'); empty "
                                 "or 'none': no tracker")
    max_bad_steps: int = setting(3, "non-finite loss or gradient norm this many steps in a row: stop (with a "
                                    "checkpoint)")
    eval_every: int = setting(0, "> 0: held-out loss every this many steps and at the end")
    eval_data: str = setting("", "the held-out source (as --data); empty: the training source with another seed")
    eval_batches: int = setting(1, "batches of the held-out set (the same ones at every evaluation)")
    seed: int = setting(0, "seeds the weights of a preset, the data order and the needles")

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
        unset = {f.name for f in fields(self) if f.default is None}  # None: left to the run
        for name, low in INT_FIELDS.items():
            value = getattr(self, name)
            if (name == "chunk_size" and value == "auto") or (value is None and name in unset):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be a whole number >= {low}")
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        for f in fields(self):  # the fixed sets of choices declared with the fields
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name}={getattr(self, f.name)!r} must be one of {', '.join(choices)}")
        if self.seed >= 2**63:
            raise ValueError(f"seed={self.seed} must be < 2**63 (torch's and numpy's generators take 64-bit seeds)")
        for name, (low, strict, fix) in FLOAT_FIELDS.items():
            value = getattr(self, name)
            if value is None and name in unset:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < low or (strict and value == low):
                raise ValueError(f"{name}={value!r} must be {'>' if strict else '>='} {low:g} and finite: {fix}")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"weight_decay={self.weight_decay:g} with lr={self.lr:g}: AdamW multiplies every weight by "
                             f"1 - lr x weight_decay = {1 - self.lr * self.weight_decay:g} each step, which must stay "
                             "above 0; lower --weight-decay (typical: 0.1)")
        if self.sparse_budget:
            check_policy_name(self.sparse_policy)
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
        if "tensorboard" in tracker_names(self.report_to) and not self.output_dir:
            raise ValueError(f"report_to={self.report_to!r}: tensorboard writes its event files into "
                             "<output_dir>/tensorboard and no output_dir is given; add --output-dir DIR")
        check_token_suffix(self.data, "--data")
        if self.eval_data:
            check_token_suffix(self.eval_data, "--eval-data")
        self.needle_template = self.needle_template.replace("\\n", "\n")  # as typed on a command line
        if not 0 <= self.shutdown_timeout < math.inf:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} must be a number of seconds >= 0 (0: no limit)")
        if not 0 < self.process_group_timeout < math.inf:
            raise ValueError(f"process_group_timeout={self.process_group_timeout} must be a number of seconds > 0")
        if self.liger and self.tp > 1:
            raise ValueError(f"liger=True with tp={self.tp}: Liger's kernels take no tensor-parallel (DTensor) "
                             "inputs; train with tp=1 or without liger")
        if self.float8 != "none" and self.tp > 1:
            raise ValueError(f"float8={self.float8!r} with tp={self.tp}: oomb's tensor-parallel plan splits plain "
                             "Linear layers, not float8 ones; train with tp=1 or float8='none'")
        master_weights_refusal(self.master_weights, self.dtype, self.lora_rank, self.optimizer, self.tp)
        if self.optimizer == "adamw8bit" and self.tp > 1:  # torchao 0.18: its 8-bit state fails inside DTensor
            raise ValueError(f"optimizer='adamw8bit' with tp={self.tp}: torchao's 8-bit state does not run on "
                             "tensor-parallel (DTensor) weights; use --optimizer adamw with --tp, or --tp 1")


def config_yaml(cfg: TrainConfig) -> str:
    """Every field of cfg, in declaration order, as the YAML `--config` reads."""
    import yaml

    class Dumper(yaml.SafeDumper):
        """Text with a newline (needle_template) as one double-quoted line with \\n in it."""

    Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style='"' if "\n" in text else None))
    return ("# oomb train settings, every one as this run used them: `oomb train --config FILE` runs them again\n"
            "# (flags given beside it override them)\n"
            + yaml.dump(asdict(cfg), Dumper=Dumper, sort_keys=False, allow_unicode=True, width=120))
