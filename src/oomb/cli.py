"""`oomb train | plan | eval`: thin wrappers that parse flags into dataclasses and call in."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys

import torch


def _add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool) or str(f.type) == "bool | None":  # None: decided from other flags
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        kind = {"float | None": float, "int | None": int}.get(str(f.type), type(f.default))
        if f.name == "seq_len":
            kind = parse_tokens  # 64K, 1M
        parser.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default!r})")


def parse_tokens(text: str, low: int = 1) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '4096' -> 4096: a whole number of tokens >= low (an
    argparse error naming the text otherwise: inf, nan, 0, negative, fractional, not a number)."""
    t = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < low or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens >= {low}; use e.g. 4096, 64K "
                                         "or 1M")
    return int(value)


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


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
                        keep_attention=args.keep_attention)
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
            print(choice.summary(planned=False))
        print(f"{args.model}: {args.batch} x {seq_len:,} tokens, chunk {engine.chunk_size}, page {args.page_size}, "
              f"bf16 weights, {grads}, {str(engine.kv_grad_dtype).removeprefix('torch.')} dK/dV pages"
              f"{', layers recomputed' if engine.checkpoint_layers else ''}, optimizer {args.optimizer}{ranks}")
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

    if args.task not in EVAL_TASKS:
        raise ValueError(f"--task {args.task!r} is not one of {', '.join(EVAL_TASKS)}")
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
    from .train.sources import tokenize

    n = tokenize(args.model, args.inputs, args.output, args.text_field, args.messages_field)
    chats = f", {n['chats']:,} of them chats; {n['trained']:,} tokens trained" if n["chats"] else ""
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


def main(argv: list[str] | None = None) -> None:
    from .memory.device import ALLOCATOR_SETTINGS
    from .train.config import TrainConfig
    from .train.data import BIN_DTYPES
    from .train.needles import DEFAULT_TEMPLATE

    # Read when CUDA is first used, which is later: the user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)

    parser = argparse.ArgumentParser(prog="oomb", description="Million-token-context training on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a model (default: the embedded tiny demo, CPU is enough)")
    _add_dataclass_args(p_train, TrainConfig)
    p_train.set_defaults(func=cmd_train)

    p_plan = sub.add_parser("plan", help="memory a training step needs, before allocating any")
    p_plan.add_argument("--model", default="qwen2.5-7b", help="preset name or local checkpoint")
    p_plan.add_argument("--seq-len", type=parse_tokens, nargs="+", default=[2**20], help="e.g. 64K 1M")
    p_plan.add_argument("--batch", type=at_least(1), default=1)
    p_plan.add_argument("--chunk-size", type=lambda t: t if t == "auto" else at_least(1)(t), default="auto",
                        help="tokens, or auto (as oomb train chooses it)")
    p_plan.add_argument("--page-size", type=at_least(1), default=128)
    p_plan.add_argument("--group-pages", type=at_least(1), default=1024,
                        help="pages per attention call: a dense host layer stages this many at a time")
    p_plan.add_argument("--kv-grad-dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p_plan.add_argument("--offload", choices=["none", "all", "auto"], default="auto")
    p_plan.add_argument("--checkpoint-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="recompute each layer in backward (default: auto)")
    p_plan.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="the layers run compiled (train's --compile), which keeps fewer activations "
                             "(default: as oomb train on a GPU, on for dense families without LoRA)")
    p_plan.add_argument("--keep-attention", action="store_true",
                        help="stage 1 keeps the attention outputs for stage 2 (as many layers' as fit beside the "
                             "pages on the GPU, the others in pinned host memory)")
    p_plan.add_argument("--lora-rank", type=at_least(0), default=0, help="LoRA on attention, base frozen (0: full)")
    p_plan.add_argument("--sparse-budget", type=at_least(0), default=0,
                        help="> 0: top-k sparse attention (its page representatives and kept selections)")
    p_plan.add_argument("--optimizer", choices=["adamw", "adamw8bit", "none"], default="adamw",
                        help="adamw: two bf16 moments (4 B per parameter); adamw8bit: 8-bit moments (2 B); "
                             "none: gradients only (the engine benchmarks)")
    p_plan.add_argument("--param-grad-dtype", choices=["float32", "param"], default="float32",
                        help="what the parameters' chunk gradients are summed in (the trainer's default: float32; "
                             "param: the weights' bf16, as the engine's default)")
    p_plan.add_argument("--tp", type=at_least(1), default=1,
                        help="tensor-parallel ranks sharing each layer's heads, KV pages and MLP: per-GPU plan")
    p_plan.add_argument("--dp", type=at_least(1), default=1,
                        help="data-parallel ranks sharing AdamW's state (ZeRO-1, the trainer's default): per-GPU plan")
    p_plan.add_argument("--gpu-memory", type=parse_bytes, default=parse_bytes("139.8GiB"), help="default: one H200")
    p_plan.add_argument("--host-memory", type=parse_bytes, default=parse_bytes("110GiB"),
                        help="host RAM pages may pin (default: what a 128 GiB machine leaves)")
    p_plan.add_argument("--json", action="store_true")
    p_plan.set_defaults(func=cmd_plan)

    p_eval = sub.add_parser("eval", help="evaluate a model: loss, loss by position, needle retrieval, key-value "
                                         "recall by distance, top-k recall")
    p_eval.add_argument("--task", default="loss", help=f"one of {', '.join(EVAL_TASKS)} (default: loss)")
    p_eval.add_argument("--model", default="tiny")
    p_eval.add_argument("--data", default="copy",
                        help="copy, or a .npy / .bin token file: its first non-overlapping windows of --seq-len "
                             "(retrieval: the text the needles hide in)")
    p_eval.add_argument("--data-dtype", choices=BIN_DTYPES, default="uint16", help="of a .bin file's token ids")
    p_eval.add_argument("--seq-len", type=parse_tokens, default=4096)
    p_eval.add_argument("--batches", type=at_least(1), default=4, help="evaluate calls (token files: windows / --batch)")
    p_eval.add_argument("--batch", type=at_least(1), default=1, help="sequences per evaluate call")
    p_eval.add_argument("--chunk-size", type=at_least(1), default=1024)
    p_eval.add_argument("--page-size", type=at_least(1), default=128)
    p_eval.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p_eval.add_argument("--offload", choices=["none", "all", "auto"], default="auto",
                        help="where K/V pages live (auto: the GPU while they fit, then the host)")
    p_eval.add_argument("--sparse-budget", type=at_least(0), default=0,
                        help="> 0: top-k sparse attention over this many pages")
    p_eval.add_argument("--sparse-chunk-budget", type=at_least(0), default=0, help="0: max(256, --sparse-budget)")
    p_eval.add_argument("--sparse-sink-pages", type=at_least(0), default=1)
    p_eval.add_argument("--sparse-representative", choices=["mean", "minmax"], default="mean")
    p_eval.add_argument("--sparse-dense-layers", default="", help="layers attending densely among top-k ones, e.g. -2,-1")
    p_eval.add_argument("--rope-theta", type=positive_number, default=None,
                        help="a new RoPE base (context extension)")
    p_eval.add_argument("--rope-scaling", default="", help="TYPE:FACTOR, TYPE one of linear, dynamic, yarn, llama3")
    p_eval.add_argument("--buckets", type=lambda t: [parse_tokens(x, low=0) for x in t.split(",")], default=None,
                        help="position-loss: bucket starts, e.g. 0,1024,4096 (default: 0 and powers of two up to "
                             "seq_len)")
    p_eval.add_argument("--lengths", type=lambda t: [parse_tokens(x) for x in t.split(",")], default=[4096],
                        help="retrieval: context lengths, e.g. 16K,64K,256K")
    p_eval.add_argument("--depths", type=parse_depths, default=[0, 0.25, 0.5, 0.75, 1],
                        help="retrieval: needle depths (0: start, 1: end)")
    p_eval.add_argument("--samples", type=at_least(1), default=4, help="retrieval: sequences per (length, depth)")
    p_eval.add_argument("--needle-template", default=DEFAULT_TEMPLATE,
                        help="retrieval: the needle, with {key} then {value}; the query is its text up to {value}")
    p_eval.add_argument("--tokenizer", default="", help="retrieval: 'bytes' or a checkpoint (default: the model's)")
    p_eval.add_argument("--recall-keys", type=at_least(2), default=256, help="kv-recall: key ids (as oomb train's)")
    p_eval.add_argument("--recall-values", type=at_least(2), default=256, help="kv-recall: value ids (chance: 1 / values)")
    p_eval.add_argument("--recall-first-id", type=at_least(0), default=None,
                        help="kv-recall: the first key id (default: the top of the vocabulary, as oomb train's)")
    p_eval.add_argument("--recall-pairs", type=at_least(1), default=64, help="kv-recall: pairs in each sequence")
    p_eval.add_argument("--queries", type=at_least(1), default=256, help="kv-recall: queries in each distance bucket")
    p_eval.add_argument("--distance-buckets", type=lambda t: [parse_tokens(x, 0) for x in t.split(",")], default=None,
                        help="kv-recall: needle-to-query distance edges, e.g. 0,4K,16K,32K,64K (default: 0, 4K, "
                             "16K, 32K, then doubling, up to seq_len); pairs within one chunk are a bucket of their own")
    p_eval.add_argument("--recall-chunks", type=at_least(1), default=8, help="selection-recall: chunks sampled per sequence")
    p_eval.add_argument("--recall-blocks", type=at_least(1), default=4, help="selection-recall: query blocks per chunk")
    p_eval.add_argument("--device", default="auto")
    p_eval.add_argument("--seed", type=at_least(0), default=1)
    p_eval.add_argument("--json", action="store_true", help="the result as one JSON object, the last line of stdout")
    p_eval.add_argument("--plot", default="", help="write a PNG of the result here")
    p_eval.set_defaults(func=cmd_eval)

    p_corpus = sub.add_parser("corpus", help="a long-document corpus from installed packages' source code")
    p_corpus.add_argument("--output", required=True, help="directory for train.npy, heldout.npy, corpus.json")
    p_corpus.add_argument("--roots", nargs="*", default=[], help="package directories (default: site-packages)")
    p_corpus.add_argument("--tokenizer", default="bytes", help="'bytes' (byte-level) or a checkpoint's tokenizer")
    p_corpus.add_argument("--heldout", type=float, default=0.1, help="share of packages held out (by name hash)")
    p_corpus.add_argument("--max-size", type=parse_bytes, default=None,
                          help="text to take for training, e.g. 300MiB (default: all)")
    p_corpus.set_defaults(func=cmd_corpus)

    p_tok = sub.add_parser("tokenize", help="text or chat records -> a document file (.npy token ids) for --data")
    p_tok.add_argument("inputs", nargs="+", help=".txt files (a document each), .jsonl (a record per line), .json (a "
                                                 "list of records), .parquet, or datasets' save_to_disk directories")
    p_tok.add_argument("--model", required=True, help="a checkpoint directory or hub id with a tokenizer")
    p_tok.add_argument("--output", required=True,
                       help="the .npy ids to write; NAME.docs.npy (document starts) and, for chats, NAME.mask.npy "
                            "(trained tokens) go beside it")
    p_tok.add_argument("--text-field", default="text", help="the records' field holding text (every token trained)")
    p_tok.add_argument("--messages-field", default="messages",
                       help="the records' field holding chat turns ({role, content}; the assistant's tokens trained)")
    p_tok.set_defaults(func=cmd_tokenize)

    args = parser.parse_args(argv)
    from .train.interrupt import TrainingStopped

    try:
        with command_output():
            args.func(args)
    except ValueError as e:  # user errors: one clear line, no stack trace
        sys.exit(f"oomb {args.command}: error: {e}")
    except TrainingStopped as e:
        sys.exit(f"oomb {args.command}: stopped: {e}")


if __name__ == "__main__":
    main()
