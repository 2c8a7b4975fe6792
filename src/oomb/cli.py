"""`oomb train | plan | eval | export`: thin wrappers that parse flags into dataclasses and call in."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from .flags import HelpFormatter, add_config_flag, add_settings, at_least, help_of, parse_tokens, read_config


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]: needle depths, each a number from 0 (start) to 1 (end)."""
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        depths = [math.nan]
    if not all(0 <= d <= 1 for d in depths):
        raise argparse.ArgumentTypeError(f"{text!r} must be depths from 0 (start) to 1 (end), e.g. 0,0.5,1")
    return depths


def cmd_train(args) -> None:
    from .train.config import TrainConfig
    from .train.trainer import train

    from .config import KernelOptions

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    train(TrainConfig(**{k: v for k, v in vars(args).items() if k in names}),
          kernels=KernelOptions.from_env(os.environ))


def parse_bytes(text: str) -> int:
    """'139.8GiB', '512MiB', '80GB' -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)]) * units[unit]
            except ValueError:
                break
            if math.isfinite(value) and value >= 0:
                return int(value)
            break
    raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 139.8GiB, 512MiB or 80GB")


def cmd_plan(args) -> None:
    from .attention.sparse import TopKPages
    from .auto import AUTO_FIELDS, Machine, NothingFits, choose, compiles
    from .config import EngineConfig
    from .plan import human_bytes, longest_context, place, plan
    from .presets import load_config

    config = load_config(args.model)  # a preset, or a checkpoint's config.json: one clear error for neither
    trainable = lora_params(config, args.lora_rank, args.tp) if args.lora_rank else None
    opt_bytes = {"adamw": None, "adamw8bit": 2, "none": 0}[args.optimizer]  # None: two moments like the weights
    given = {"chunk_size": None if args.chunk_size == "auto" else args.chunk_size,
             "kv_grad_dtype": {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.kv_grad_dtype],
             "checkpoint_layers": args.checkpoint_layers}
    free = tuple(k for k in AUTO_FIELDS if given[k] is None)  # as oomb train chooses them (oomb.auto)

    sparse = TopKPages(budget=args.sparse_budget) if args.sparse_budget else None
    base = EngineConfig(**{k: v for k, v in given.items() if v is not None}, page_size=args.page_size,
                        offload=args.offload, sparse=sparse, group_pages=args.group_pages,
                        compile_layers=compiles(config, torch.device("cuda"), bool(args.lora_rank))
                        if args.compile is None else args.compile,
                        param_grad_dtype=torch.float32 if args.param_grad_dtype == "float32" else None,
                        # unset: a run keeps only the outputs that fit beside the pages, never what decides
                        # whether its step fits: counted when asked for (--keep-attention)
                        keep_attention=bool(args.keep_attention))
    machine = Machine(args.gpu_memory, args.host_memory)
    plan_args = dict(batch=args.batch, trainable_params=trainable, optimizer_bytes_per_param=opt_bytes,
                     optimizer_shards=args.dp, tp=args.tp)

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
        grads = f"LoRA r={args.lora_rank}" if args.lora_rank else "full-parameter gradients"
        ranks = "" if args.tp == 1 and args.dp == 1 else f", per GPU of TP={args.tp} x DP={args.dp}"
        if choice is not None:
            print(choice.summary())
        print(f"{args.model}: {args.batch} x {seq_len:,} tokens, chunk {engine.chunk_size}, page {args.page_size}, "
              f"bf16 weights, {grads}, {str(engine.kv_grad_dtype).removeprefix('torch.')} dK/dV pages"
              f"{', layers recomputed' if engine.checkpoint_layers else ''}, optimizer {args.optimizer}{ranks}")
        print(p.table())
        print(f"pages: {p.bytes_per_token() / 1024:.1f} KiB per token; GPU memory with offload all grows by "
              f"{p.selections / max(1, p.batch * seq_len) * 1e4 / 1e6:.2f} MB per 10K tokens (sparse selections"
              + ("; kept attention outputs fill the room left on the GPU, then go to the host)"
                 if p.kept_attention else ")"))
        print(placement(seq_len, engine).summary())
    if not args.json:
        def fits(n):
            engine, _ = engine_for(n)
            return engine is not None and placement(n, engine).fits
        longest = longest_context(fits, base.page_size if free else base.chunk_size)
        print(f"longest context that fits with offload {args.offload}: {longest:,} tokens "
              f"(GPU {human_bytes(args.gpu_memory)}, host {human_bytes(args.host_memory)})")


def lora_params(config, rank: int, tp: int = 1) -> int:
    """Trainable parameters of LoRA rank `rank` on the attention projections (q, k, v, o), on one
    rank of tensor-parallel degree `tp`: a column-parallel projection's B is split with it, a
    row-parallel one's A (oomb.parallel); the other factor is whole on every rank."""
    from .plan import head_dim_of

    hidden, head_dim = config.hidden_size, head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = rank * (4 * hidden + (2 * q + 2 * kv) // tp)  # A of q/k/v and B of o whole
    return config.num_hidden_layers * per_layer


EVAL_TASKS = ("loss", "position-loss", "retrieval", "kv-recall", "selection-recall")


def eval_batches(args, vocab: int):
    """The evaluated sequences: a token file's first windows of seq_len (non-overlapping, the same
    every run), a document file's first packed sequences (each document attending to itself,
    position_ids restarting at its start; chat files score the assistant's tokens only), or
    `args.batches` generated batches of the copy task."""
    from itertools import islice

    from .train.data import copy_task, load_tokens, windows
    from .train.documents import evaluation_batches, has_documents, open_documents

    if args.data == "copy":
        return list(islice(copy_task(vocab, args.seq_len, args.batch, seed=args.seed), args.batches))
    if has_documents(args.data):
        return list(evaluation_batches(open_documents(args.data, vocab), args.seq_len, args.batch,
                                       args.batches * args.batch))
    data = load_tokens(args.data, vocab, args.seq_len, args.data_dtype)
    return list(windows(data, args.seq_len, args.batch, args.batches * args.batch))


def cmd_eval(args) -> None:
    from .config import KernelOptions
    from .engine import ChunkRecurrentEngine
    from .eval import plots, tasks
    from .models.rope import check_positions
    from .presets import load_model
    from .train.data import check_token_suffix, load_tokens
    from .train.metrics import ChunkBars
    from .train.outputs import make_folder
    from .train.trainer import codec_for, resolve_device, sparse_config

    check_token_suffix(args.data, "--data")
    if args.plot:  # its folder now: the evaluation's result is not lost to a missing one
        make_folder(os.path.dirname(args.plot), f"--plot {args.plot}")
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)  # a preset's random weights, the same every run
    model = load_model(args.model, dtype=dtype, device=device, rope_theta=args.rope_theta,
                       rope_scaling=args.rope_scaling or None).eval()
    longest = max(args.lengths) if args.task == "retrieval" else args.seq_len
    check_positions(model.config, longest, args.rope_theta, args.rope_scaling)
    engine = ChunkRecurrentEngine(model, chunk_size=args.chunk_size, page_size=args.page_size, offload=args.offload,
                                  backend=args.backend, sparse=sparse_config(args),
                                  kernels=KernelOptions.from_env(os.environ),
                                  kv_grad_dtype=None)  # no backward: no dK/dV
    vocab = engine.adapter.vocab_size
    bar = ChunkBars("sequence batch {n}")
    try:
        if args.task == "loss":
            result = tasks.mean_loss(engine, eval_batches(args, vocab), bar)
        elif args.task == "position-loss":
            result = tasks.position_loss(engine, eval_batches(args, vocab), args.seq_len, args.buckets, bar)
        elif args.task == "selection-recall":
            result = tasks.selection_recall(engine, eval_batches(args, vocab), args.seq_len, args.recall_chunks,
                                            args.recall_blocks, args.seed, bar)
        elif args.task == "kv-recall":
            result = kv_recall(args, engine, vocab, bar)
        else:
            haystack = None if args.data == "copy" else load_tokens(args.data, vocab, max(args.lengths),
                                                                     args.data_dtype)
            codec = codec_for(args.tokenizer, args.model, vocab)
            result = tasks.retrieval(engine, haystack, codec, args.lengths, args.depths, args.samples,
                                     args.needle_template.replace("\\n", "\n"), args.seed, args.batch, bar)
    finally:
        bar.close()
    result = {**result, "model": args.model, "data": args.data,
              "attention": f"top-{args.sparse_budget}" if args.sparse_budget else "dense"}
    _print_eval(result)
    if args.plot:
        label = f"{args.model} ({result['attention']})"
        {"position-loss": lambda: plots.position_loss({label: result}, args.plot),
         "retrieval": lambda: plots.retrieval(result, args.plot, f"retrieval: {label}"),
         "selection-recall": lambda: plots.selection_recall({label: result}, args.plot),
         "loss": lambda: None}[args.task]()
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


def kv_recall(args, engine, vocab: int, bar) -> dict:
    """`--task kv-recall`: recall pairs in equal numbers per distance bucket, in the held-out text."""
    from .eval.tasks import kv_recall as run
    from .train.data import load_tokens
    from .train.recall import RecallTask, default_edges, evaluation_sequences

    task = RecallTask(args.recall_keys, args.recall_values, args.recall_first_id)
    edges = args.distance_buckets or default_edges(args.seq_len)
    haystack = None
    if args.data != "copy":
        haystack = load_tokens(args.data, vocab, args.seq_len, args.data_dtype)
        task.check_text(haystack, vocab, args.data)
    sequences = evaluation_sequences(haystack, task, vocab, args.seq_len, args.chunk_size, edges, args.queries,
                                     args.recall_pairs, args.seed)
    return run(engine, sequences, task, edges, args.batch, bar)


def _print_eval(r: dict) -> None:
    head = f"{r['task']}: {r['model']} on {r['data']}, {r['attention']} attention"
    if r["task"] == "loss":
        print(f"{head}: loss {r['loss']:.4f} over {r['tokens']:,} tokens")
    elif r["task"] == "position-loss":
        print(f"{head}: loss {r['loss']:.4f} over {r['tokens']:,} tokens; by position:")
        for b in r["buckets"]:
            print(f"  [{b['start']:>9,}, {b['end']:>9,})  {b['tokens']:>10,} tokens  loss {b['loss']:.4f}")
    elif r["task"] == "retrieval":
        print(f"{head}: mean accuracy {r['mean_accuracy']:.3f} ({r['samples']} samples a cell)")
        print("  length \\ depth " + "".join(f"{d:>7g}" for d in r["depths"]))
        for n, row in zip(r["lengths"], r["accuracy"]):
            print(f"  {n:>14,} " + "".join(f"{a:>7.2f}" for a in row))
    elif r["task"] == "kv-recall":
        print(f"{head}: accuracy {r['accuracy']:.3f} over {r['queries']:,} queries (chance {r['chance']:.4f}); "
              "by needle-to-query distance:")
        for b in r["buckets"]:
            print(f"  {b['bucket']:>12}  {b['queries']:>6,} queries  accuracy {b['accuracy']:.3f} "
                  f"[{b['ci_low']:.3f}, {b['ci_high']:.3f}]  answer loss {b['answer_loss']:.4f}")
        for x in r.get("hit_rate", []):
            heads = " ".join(f"{h:.2f}" for h in x["heads"])
            print(f"  layer {x['layer']:>3}  needle-page hit rate {x['rate']:.3f} (KV heads {heads})")
    else:
        print(f"{head}: recall {r['recall']:.4f}, of the earlier pages' mass {r['earlier_recall']:.4f}")
        for x in r["layers"]:
            print(f"  layer {x['layer']:>3}  recall {x['recall']:.4f}  earlier {x['earlier_recall']:.4f}  "
                  f"({x['blocks']} blocks)")


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


def cmd_export(args) -> None:
    from .train.export import export

    path = export(args.checkpoint, args.output, args.merge, args.overwrite)
    print(f"exported {args.checkpoint} to {path}")


#: the TrainConfig settings `oomb plan` takes (as oomb train's flags, but for PLAN_OVERRIDES)
PLAN_FIELDS = ("model", "seq_len", "batch", "chunk_size", "page_size", "group_pages", "kv_grad_dtype", "offload",
               "checkpoint_layers", "compile", "keep_attention", "lora_rank", "sparse_budget", "optimizer",
               "param_grad_dtype", "tp")
PLAN_OVERRIDES = {
    "model": {"default": "qwen2.5-7b"},  # plan is for models worth planning: the tiny demo needs none
    # several lengths in one call, each planned (then the longest context that fits)
    "seq_len": {"nargs": "+", "default": [2**20], "help": "tokens in each sequence, one plan each, e.g. 64K 1M"},
    # what the engine benchmarks run: gradients only, no optimizer state
    "optimizer": {"choices": ("adamw", "adamw8bit", "none"),
                  "help": help_of("optimizer") + "; none: gradients only (the engine benchmarks)"},
}
#: the TrainConfig settings `oomb eval` takes (as oomb train's flags, but for EVAL_OVERRIDES)
EVAL_FIELDS = ("model", "data", "data_dtype", "seq_len", "batch", "chunk_size", "page_size", "backend", "offload",
               "sparse_budget", "sparse_chunk_budget", "sparse_sink_pages", "sparse_representative",
               "sparse_dense_layers", "rope_theta", "rope_scaling", "needle_template", "tokenizer", "recall_keys",
               "recall_values", "recall_first_id", "recall_pairs", "device", "seed")
EVAL_OVERRIDES = {
    # eval builds its engine directly: oomb.auto's 'auto' plans a training step (its dK/dV, its optimizer)
    "chunk_size": {"default": 1024, "type": at_least(1)},
    # kv-recall scores recall pairs, so it needs some (train's 0 means no recall task)
    "recall_pairs": {"default": 64, "type": at_least(1)},
    # not train's default 0: a model trained with the defaults is scored on other copy-task sequences
    "seed": {"default": 1},
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """`oomb` and its subcommands' parsers, by name."""
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
        "eval", help="evaluate a model: loss, loss by position, needle retrieval, key-value recall by distance, "
                     "top-k recall", formatter_class=HelpFormatter,
        description="A token file's first non-overlapping windows of --seq-len are evaluated (retrieval: the text "
                    "the needles hide in); the model's settings are oomb train's flags.")
    p_eval.add_argument("--task", default="loss", choices=EVAL_TASKS, help="what is measured")
    add_settings(p_eval, EVAL_FIELDS, EVAL_OVERRIDES)
    p_eval.add_argument("--batches", type=at_least(1), default=4, help="evaluate calls (token files: windows / --batch)")
    p_eval.add_argument("--buckets", type=lambda t: [parse_tokens(x, low=0) for x in t.split(",")], default=None,
                        help="position-loss: bucket starts, e.g. 0,1024,4096 (default: 0 and powers of two up to "
                             "seq_len)")
    p_eval.add_argument("--lengths", type=lambda t: [parse_tokens(x) for x in t.split(",")], default=[4096],
                        help="retrieval: context lengths, e.g. 16K,64K,256K")
    p_eval.add_argument("--depths", type=parse_depths, default=[0, 0.25, 0.5, 0.75, 1],
                        help="retrieval: needle depths (0: start, 1: end)")
    p_eval.add_argument("--samples", type=at_least(1), default=4, help="retrieval: sequences per (length, depth)")
    p_eval.add_argument("--queries", type=at_least(1), default=256, help="kv-recall: queries in each distance bucket")
    p_eval.add_argument("--distance-buckets", type=lambda t: [parse_tokens(x, 0) for x in t.split(",")], default=None,
                        help="kv-recall: needle-to-query distance edges, e.g. 0,4K,16K,32K,64K (default: 0, 4K, "
                             "16K, 32K, then doubling, up to seq_len); pairs within one chunk are a bucket of their own")
    p_eval.add_argument("--recall-chunks", type=at_least(1), default=8, help="selection-recall: chunks sampled per sequence")
    p_eval.add_argument("--recall-blocks", type=at_least(1), default=4, help="selection-recall: query blocks per chunk")
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
        args.func(args)
    except ValueError as e:  # user errors: one clear line, no stack trace
        sys.exit(f"oomb {args.command}: error: {e}")
    except TrainingStopped as e:
        sys.exit(f"oomb {args.command}: stopped: {e}")


if __name__ == "__main__":
    main()
