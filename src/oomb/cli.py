"""`oomb train | plan | eval | export`: thin wrappers that parse flags into dataclasses and call in."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch

from .flags import HelpFormatter, add_config_flag, add_settings, at_least, attach_negative_values, help_of, read_config
from .plan import lora_params
from .units import parse_bytes


def cmd_train(args) -> None:
    from .train.config import TrainConfig
    from .train.trainer import train

    from .config import KernelOptions

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    train(TrainConfig(**{k: v for k, v in vars(args).items() if k in names}),
          kernels=KernelOptions.from_env(os.environ))


def lora_of(args) -> tuple[int, tuple[str, ...] | None]:
    """The LoRA a plan counts: --lora-rank on the family's targets, else the rank and target
    modules of the LoRA adapter --model names (0: full-parameter training)."""
    from .train.export import describe

    if args.lora_rank:
        return args.lora_rank, None
    artefact = describe(args.model)
    lora = artefact.lora if artefact is not None else None
    if lora is None:
        return 0, None
    targets = lora.target_modules
    return lora.r, (targets,) if isinstance(targets, str) else tuple(sorted(targets))


def cmd_plan(args) -> None:
    from .attention.policy import build_policy
    from .auto import AUTO_FIELDS, Machine, NothingFits, choose, compiles
    from .config import EngineConfig
    from .plan import human_bytes, longest_context, place, plan
    from .presets import load_config
    from .train.config import master_weights_refusal

    config = load_config(args.model)  # a preset, or a checkpoint's config.json: one clear error for neither
    rank, targets = lora_of(args)
    trainable = lora_params(config, rank, args.tp, targets) if rank else None
    master_weights_refusal(args.master_weights, "bfloat16", rank, args.optimizer, args.tp)  # the plan's bf16 weights
    opt_bytes = {"adamw": None, "adamw8bit": 2, "none": 0}[args.optimizer]  # None: two moments like the weights
    given = {"chunk_size": None if args.chunk_size == "auto" else args.chunk_size,
             "kv_grad_dtype": {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.kv_grad_dtype],
             "checkpoint_layers": args.checkpoint_layers}
    free = tuple(k for k in AUTO_FIELDS if given[k] is None)  # as oomb train chooses them (oomb.auto)

    sparse = build_policy(args)  # the policy oomb train builds from the same settings
    base = EngineConfig(**{k: v for k, v in given.items() if v is not None}, page_size=args.page_size,
                        offload=args.offload, sparse=sparse, group_pages=args.group_pages,
                        compile_layers=compiles(config, torch.device("cuda"), bool(rank))
                        if args.compile is None else args.compile,
                        param_grad_dtype=torch.float32 if args.param_grad_dtype == "float32" else None,
                        # unset: a run keeps only the outputs that fit beside the pages, never what decides
                        # whether its step fits: counted when asked for (--keep-attention)
                        keep_attention=bool(args.keep_attention))
    machine = Machine(args.gpu_memory, args.host_memory)
    plan_args = dict(batch=args.batch, trainable_params=trainable, optimizer_bytes_per_param=opt_bytes,
                     optimizer_shards=args.dp, tp=args.tp, master_weights=args.master_weights != "none")

    def engine_for(seq_len):
        """The step's settings: the given ones, the free ones as oomb train would choose them."""
        if not free:
            return base, None
        try:
            choice = choose(config, seq_len, machine, base, free, **plan_args)
            return choice.engine, choice
        except NothingFits as e:
            return None, e

    def step_plan(seq_len, engine):
        return plan(config, seq_len, engine=engine, **plan_args)

    def placement(seq_len, engine):
        return place(step_plan(seq_len, engine), args.offload, args.gpu_memory, args.host_memory)

    for seq_len in args.seq_len:
        engine, choice = engine_for(seq_len)
        if engine is None:  # nothing fits: the reason, and the plan of the most frugal settings
            print(f"{args.model}: {choice}")
            continue
        p = step_plan(seq_len, engine)
        if args.json:
            print(json.dumps({**p.as_dict(), "placement": dataclasses.asdict(placement(seq_len, engine)),
                              "auto": choice.summary() if choice is not None else None}))
            continue
        grads = f"LoRA r={rank}" + (" (the adapter's)" if rank != args.lora_rank else "") if rank else \
            "full-parameter gradients"
        ranks = "" if args.tp == 1 and args.dp == 1 else f", per GPU of TP={args.tp} x DP={args.dp}"
        if choice is not None:
            print(choice.summary(planned=False))
        print(f"{args.model}: {args.batch} x {seq_len:,} tokens, chunk {engine.chunk_size}, page {args.page_size}, "
              f"bf16 weights, {grads}, {str(engine.kv_grad_dtype).removeprefix('torch.')} dK/dV pages"
              f"{', layers recomputed' if engine.checkpoint_layers else ''}, optimizer {args.optimizer}"
              f"{', fp32 master weights' if args.master_weights != 'none' else ''}{ranks}")
        fit = placement(seq_len, engine)
        print(fit.table(p))
        growth = (f"; with offload all, GPU memory grows by {p.selections / max(1, p.batch * seq_len) * 1e4 / 1e6:.2f} "
                  "MB per 10K tokens (the sparse selections)" if sparse is not None else "")
        print(f"pages: {p.bytes_per_token() / 1024:.1f} KiB per token of context{growth}")
        print(fit.summary())
    if not args.json:
        def fits(n):
            engine, _ = engine_for(n)
            return engine is not None and placement(n, engine).fits
        longest = longest_context(fits, base.page_size if free else base.chunk_size)
        print(f"longest context that fits with offload {args.offload}: {longest:,} tokens "
              f"(GPU {human_bytes(args.gpu_memory)}, host {human_bytes(args.host_memory)})")


def cmd_eval(args) -> None:
    """Builds the model and an evaluation engine (no dK/dV pages) from the shared flags, runs the
    registered task --task names on it, prints its report, then its plot and --json."""
    from .attention.policy import build_policy
    from .config import KernelOptions
    from .data.tokens import check_token_suffix
    from .engine import ChunkRecurrentEngine
    from .eval import TASKS
    from .models.rope import check_positions
    from .presets import load_model
    from .train.metrics import ChunkBars
    from .train.outputs import make_folder
    from .train.trainer import resolve_device

    task = TASKS[args.task]
    check_token_suffix(args.data, "--data")
    if args.plot:  # its folder now: the evaluation's result is not lost to a missing one
        if task.plot is None:
            raise ValueError(f"--task {task.name} draws no plot; leave out --plot {args.plot} (tasks with one: "
                             f"{', '.join(t.name for t in TASKS.values() if t.plot)})")
        make_folder(os.path.dirname(args.plot), f"--plot {args.plot}")
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)  # a preset's random weights, the same every run
    model = load_model(args.model, dtype=dtype, device=device, rope_theta=args.rope_theta,
                       rope_scaling=args.rope_scaling or None).eval()
    check_positions(model.config, task.longest(args), args.rope_theta, args.rope_scaling)
    engine = ChunkRecurrentEngine(model, chunk_size=args.chunk_size, page_size=args.page_size, offload=args.offload,
                                  backend=args.backend, sparse=build_policy(args),
                                  kernels=KernelOptions.from_env(os.environ),
                                  kv_grad_dtype=None)  # no backward: no dK/dV
    bar = ChunkBars("sequence batch {n}")
    try:
        result = task.run(args, engine, bar)
    finally:
        bar.close()
    result = {**result, "model": args.model, "data": args.data,
              "attention": f"top-{args.sparse_budget}" if args.sparse_budget else "dense"}
    first, *rest = task.report(result)
    print(f"{result['task']}: {result['model']} on {result['data']}, {result['attention']} attention: {first}")
    for line in rest:
        print(line)
    if args.plot:
        task.plot(result, f"{args.model} ({result['attention']})", args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


def cmd_corpus(args) -> None:
    from .train.corpus import build_corpus

    s = build_corpus(args.output, args.roots or None, args.tokenizer, args.heldout, args.max_size)
    for split in ("train", "heldout"):
        print(f"{args.output}/{split}.npy: {s[split]['tokens']:,} tokens, {s[split]['documents']} packages")


def cmd_tokenize(args) -> None:
    from .train.chat import read_template
    from .train.sources import Hub, tokenize

    n = tokenize(args.model, args.inputs, args.output, args.text_field, args.messages_field,
                 read_template(args.chat_template) if args.chat_template else None,
                 Hub(args.split, args.subset, args.streaming, args.num_proc), progress=True)
    kinds = ([f"{n['chats']:,} of them chats"] if n["chats"] else []) + \
        ([f"{n['completions']:,} prompt/completion"] if n["completions"] else [])
    chats = f", {', '.join(kinds)}; {n['trained']:,} tokens trained" if kinds else ""
    print(f"wrote {n['tokens']:,} tokens ({n['documents']:,} documents{chats}) to {', '.join(n['files'])}")


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """warnings.formatwarning for oomb's commands: the warning as one line, without the Python
    source line that raised it (which says nothing to a person running a command)."""
    text = " ".join(str(message).split())
    return f"{category.__name__}: {text}\n"


@contextlib.contextmanager
def command_output():
    """While a command runs, what it prints is its own: warnings in one line, and no transformers
    progress bars ("Loading weights" under every checkpoint load); both restored after."""
    import warnings

    from transformers.utils import logging as hf_logging

    formatwarning, bars = warnings.formatwarning, hf_logging.is_progress_bar_enabled()
    warnings.formatwarning = one_line_warning
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        warnings.formatwarning = formatwarning
        if bars:
            hf_logging.enable_progress_bar()


def cmd_export(args) -> None:
    from .train.export import export

    path = export(args.checkpoint, args.output, args.merge, args.overwrite)
    print(f"exported {args.checkpoint} to {path}")


#: the TrainConfig settings `oomb plan` takes (as oomb train's flags, but for PLAN_OVERRIDES)
PLAN_FIELDS = ("model", "seq_len", "batch", "chunk_size", "page_size", "group_pages", "kv_grad_dtype", "offload",
               "checkpoint_layers", "compile", "keep_attention", "lora_rank", "sparse_budget", "sparse_policy",
               "sparse_chunk_budget", "sparse_sink_pages", "sparse_representative", "sparse_dense_layers", "optimizer",
               "param_grad_dtype", "master_weights", "tp")
PLAN_OVERRIDES = {
    "model": {"default": "qwen2.5-7b"},  # plan is for models worth planning: the tiny demo needs none
    # several lengths in one call, each planned (then the longest context that fits)
    "seq_len": {"nargs": "+", "default": [2**20], "help": "tokens in each sequence, one plan each, e.g. 64K 1M"},
    # what the engine benchmarks run: gradients only, no optimizer state
    "optimizer": {"choices": ("adamw", "adamw8bit", "none"),
                  "help": help_of("optimizer") + "; none: gradients only (the engine benchmarks)"},
}
#: the TrainConfig settings every `oomb eval` task takes (as oomb train's flags, but for EVAL_OVERRIDES); a
#: task's own (retrieval's needle template, kv-recall's recall ids ...) come with it (oomb.eval.registry)
EVAL_FIELDS = ("model", "data", "data_dtype", "seq_len", "batch", "chunk_size", "page_size", "backend", "offload",
               "sparse_budget", "sparse_policy", "sparse_chunk_budget", "sparse_sink_pages", "sparse_representative",
               "sparse_dense_layers", "rope_theta", "rope_scaling", "device", "seed")
EVAL_OVERRIDES = {
    # eval builds its engine directly: oomb.auto's 'auto' plans a training step (its dK/dV, its optimizer)
    "chunk_size": {"default": 1024, "type": at_least(1)},
    # not train's default 0: a model trained with the defaults is scored on other copy-task sequences
    "seed": {"default": 1},
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """`oomb` and its subcommands' parsers, by name."""
    from .eval import DEFAULT_TASK, TASKS
    from .eval.registry import add_task_flags

    parser = argparse.ArgumentParser(prog="oomb", description="Million-token-context training on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {}
    p_train = commands["train"] = sub.add_parser(
        "train", help="train a model (default: the embedded tiny demo, CPU is enough)", formatter_class=HelpFormatter,
        description="Every flag is a TrainConfig setting (oomb.train.config); with --output-dir the run writes "
                    "them, as it used them, to config.yaml there, which --config reads back.")
    add_config_flag(p_train)
    add_settings(p_train)
    p_train.set_defaults(func=cmd_train)

    p_plan = commands["plan"] = sub.add_parser(
        "plan", help="memory a training step needs, before allocating any", formatter_class=HelpFormatter,
        description="The settings are oomb train's (a run's config.yaml plans that run: --config); the free ones "
                    "(auto, unset) are chosen as oomb train would choose them.")
    add_config_flag(p_plan)
    add_settings(p_plan, PLAN_FIELDS, PLAN_OVERRIDES)
    p_plan.add_argument("--dp", type=at_least(1), default=1,
                        help="data-parallel ranks sharing AdamW's state (ZeRO-1, the trainer's default): per-GPU plan")
    p_plan.add_argument("--gpu-memory", type=parse_bytes, default=parse_bytes("139.8GiB"),
                        help="the GPU's memory, e.g. 80GB (default: 139.8GiB, one H200)")
    p_plan.add_argument("--host-memory", type=parse_bytes, default=parse_bytes("110GiB"),
                        help="host RAM pages may pin (default: 110GiB, what a 128 GiB machine leaves)")
    p_plan.add_argument("--json", action="store_true", help="one JSON object per sequence length, no table")
    p_plan.set_defaults(func=cmd_plan)

    p_eval = commands["eval"] = sub.add_parser(
        "eval", help=f"evaluate a model: {', '.join(TASKS)}", formatter_class=HelpFormatter,
        description="A token file's first non-overlapping windows of --seq-len are evaluated (a task's own flags, "
                    "which start with its name, say where it reads otherwise); the model's settings are oomb train's "
                    "flags. Each task is one file of oomb.eval (docs/usage.md: how to add an eval task).")
    p_eval.add_argument("--task", default=DEFAULT_TASK, choices=tuple(TASKS),
                        help="what is measured: " + "; ".join(f"{t.name}: {t.help}" for t in TASKS.values()))
    add_settings(p_eval, EVAL_FIELDS, EVAL_OVERRIDES)
    add_task_flags(p_eval)
    p_eval.add_argument("--json", action="store_true", help="the result as one JSON object, the last line of stdout")
    p_eval.add_argument("--plot", default="", help="write a PNG of the result here")
    p_eval.set_defaults(func=cmd_eval)

    p_corpus = sub.add_parser("corpus", help="a long-document corpus from installed packages' source code")
    p_corpus.add_argument("--output", required=True, help="directory for train.npy, heldout.npy, corpus.json")
    p_corpus.add_argument("--roots", nargs="*", default=[], help="package directories (default: site-packages)")
    p_corpus.add_argument("--tokenizer", default="bytes", help="'bytes' (byte-level), bpe:VOCAB (a byte-level BPE "
                                                               "trained on the corpus, saved beside it) or a checkpoint")
    p_corpus.add_argument("--heldout", type=float, default=0.1, help="share of packages held out (by name hash)")
    p_corpus.add_argument("--max-size", type=parse_bytes, default=None,
                          help="text to take for training, e.g. 300MiB (default: all)")
    p_corpus.set_defaults(func=cmd_corpus)

    p_tok = sub.add_parser("tokenize", help="text or chat records -> a document file (.npy token ids) for --data")
    p_tok.add_argument("inputs", nargs="+", help=".txt files (a document each), .jsonl (a record per line), .json (a "
                                                 "list of records), .parquet, datasets' save_to_disk directories, "
                                                 "or datasets.load_dataset names (hub org/name, data folders)")
    p_tok.add_argument("--model", required=True,
                       help="a checkpoint directory or hub id with a tokenizer, or bytes (UTF-8 bytes as ids)")
    p_tok.add_argument("--chat-template", default="", help="a Jinja chat template file, used instead of the tokenizer's")
    p_tok.add_argument("--split", default=None, help="the split of a dataset (default: train)")
    p_tok.add_argument("--subset", default=None, help="the configuration (subset) of a hub dataset")
    p_tok.add_argument("--streaming", action="store_true", help="stream a hub dataset instead of downloading it whole")
    p_tok.add_argument("--num-proc", type=at_least(1), default=1,
                       help="processes that tokenise (and prepare a downloaded dataset)")
    p_tok.add_argument("--output", required=True,
                       help="the .npy ids to write; NAME.docs.npy (document starts) and, for chats, NAME.mask.npy "
                            "(trained tokens) go beside it")
    p_tok.add_argument("--text-field", default="text", help="the records' field holding text (every token trained)")
    p_tok.add_argument("--messages-field", default="messages",
                       help="the records' field holding chat turns ({role, content}; the assistant's tokens trained)")
    p_tok.set_defaults(func=cmd_tokenize)
    p_export = commands["export"] = sub.add_parser(
        "export", help="a run's step-N or final/ as transformers or PEFT load it; --merge: the LoRA adapter merged "
                       "into its base", formatter_class=HelpFormatter)
    p_export.add_argument("checkpoint", help="a step-N or final/ directory of oomb train")
    p_export.add_argument("--output", required=True, help="the directory to write (refused when not empty)")
    p_export.add_argument("--merge", action="store_true", help="one transformers checkpoint: base + adapter")
    p_export.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    p_export.set_defaults(func=cmd_export)
    commands.update(corpus=p_corpus, tokenize=p_tok)
    return parser, commands


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with a --config file's settings as the defaults that the flags given
    override (an error naming the file and the key exits in one line)."""
    parser, commands = build_parser()
    argv = attach_negative_values(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", ""):
        try:
            commands[args.command].set_defaults(**read_config(args.config, commands[args.command]))
        except ValueError as e:
            sys.exit(f"oomb {args.command}: error: {e}")
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    from .memory.device import ALLOCATOR_SETTINGS
    from .train.interrupt import TrainingStopped

    # Read when CUDA is first used, which is later: the user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)
    args = parse_args(argv)

    try:
        with command_output():
            args.func(args)
    except ValueError as e:  # user errors: one clear line, no stack trace
        sys.exit(f"oomb {args.command}: error: {e}")
    except TrainingStopped as e:
        sys.exit(f"oomb {args.command}: stopped: {e}")


if __name__ == "__main__":
    main()
