"""Multi-GPU training steps (forward + backward + the data-parallel gradient all-reduce, no
optimizer) of a preset model with random bf16 weights, under torchrun: seconds per step,
tokens/s in all and per GPU, peak GPU memory (the largest over ranks). `--tp` ranks share each
sequence (tensor parallel); the other ranks each take their own sequence (data parallel).

    torchrun --nproc-per-node 4 bench/bench_parallel.py --tp 4 --lengths 1M --impls dense,sparse
    torchrun --nproc-per-node 1 bench/bench_parallel.py --lengths 256K   # the DP baseline: 1 GPU
    torchrun --nproc-per-node 2 bench/bench_parallel.py --lengths 256K   # DP=2
    torchrun --nproc-per-node 4 bench/bench_parallel.py --lengths 256K   # DP=4
    torchrun --nproc-per-node 2 bench/bench_parallel.py --tp 2 --lengths 256K --compile   # TP, layers compiled
    torchrun --nproc-per-node 2 bench/bench_parallel.py --tp 2 --lengths 64K --layers 8 --profile /tmp/tp \
        && python bench/trace_gaps.py /tmp/tp   # where a TP step's time goes (rank 0)

DP scaling efficiency = tokens/s per GPU on N GPUs / tokens/s of the 1-GPU run (bench/report.py
computes it from rows of the same commit). Rank 0 appends one JSON line per (impl, length) to
--out. `--device cpu --model tiny` runs on gloo (the CI smoke test).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import profiled, record, run_info, torchrun_device  # noqa: E402

import oomb  # noqa: E402
from oomb.parallel import all_reduce_gradients, apply_tensor_parallel, global_token_count, init_distributed  # noqa: E402
from oomb.presets import load_model  # noqa: E402
from oomb.units import parse_tokens  # noqa: E402

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEEP = {"no": False, "yes": True, "fit": None}  # --keep-attention -> the engine's keep_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1, help="ranks sharing one sequence (tensor parallel)")
    ap.add_argument("--lengths", default="256K", help="tokens per sequence")
    ap.add_argument("--impls", default="dense", help="dense, sparse (TopKPages(64)) or both")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--group-pages", type=int, default=1024, help="earlier pages per attention call")
    ap.add_argument("--offload", default="auto", choices=["none", "all", "auto"])
    ap.add_argument("--kv-grad-dtype", choices=sorted(GRAD_DTYPES), default="fp32")
    ap.add_argument("--keep-attention", choices=sorted(KEEP), default="no",
                    help="stage 2 takes stage 1's attention outputs: yes (every layer), fit (as many as fit), no")
    ap.add_argument("--compile", action="store_true", help="torch.compile around attention (compile_layers)")
    ap.add_argument("--device", default="cuda", help="cpu: gloo smoke run (with --model tiny)")
    ap.add_argument("--profile", default="", help="a directory: rank 0 profiles the last length's step into it "
                    "(then: python bench/trace_gaps.py DIR)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "parallel.jsonl"))
    args = ap.parse_args()
    cuda = torchrun_device(args.device, "torchrun --nproc-per-node 4 bench/bench_parallel.py --tp 4",
                           "or --device cpu --model tiny for a gloo smoke run")
    mesh = init_distributed(args.tp)
    world, rank = dist.get_world_size(), dist.get_rank()
    dp_group = mesh["dp"].get_group()
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    info = run_info() if rank == 0 else {}

    t_start = time.perf_counter()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)  # the same weights on every rank
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32, device=device, **overrides)
    model.train()
    if args.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    vocab = model.config.vocab_size
    say(f"model built in {time.perf_counter() - t_start:.1f} s", flush=True)
    for impl in args.impls.split(","):
        if impl not in ("dense", "sparse"):
            sys.exit(f"--impls {impl!r}: use dense, sparse or dense,sparse")
        engine = oomb.ChunkRecurrentEngine(model, kernels=oomb.KernelOptions.from_env(os.environ),
                                           chunk_size=args.chunk_size, page_size=args.page_size,
                                           offload=args.offload, kv_grad_dtype=GRAD_DTYPES[args.kv_grad_dtype],
                                           group_pages=args.group_pages, keep_attention=KEEP[args.keep_attention],
                                           sparse=oomb.TopKPages(budget=64) if impl == "sparse" else None,
                                           compile_layers=args.compile)
        # two chunks at least: the layers compile for the chunk's shape, the kernels for earlier pages
        warm = torch.randint(0, vocab, (1, min(max(8192, 2 * args.chunk_size), lengths[0])), device=device)
        t0 = time.perf_counter()
        engine.forward_backward(warm)  # kernels compiled, gradients allocated
        t1 = time.perf_counter()
        engine.reserve(1, max(lengths))  # pages and pinned host memory, as a training run does once
        say(f"{impl}: warm-up step ({warm.shape[1]} tokens) {t1 - t0:.1f} s, reserve {time.perf_counter() - t1:.1f} s",
            flush=True)
        for length in lengths:
            # Each data-parallel rank its own sequence; the ranks of a TP group the same one.
            gen = torch.Generator().manual_seed(1000 + dp_rank)
            ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            dist.barrier()
            profile = bool(args.profile) and rank == 0 and length == lengths[-1]
            t0 = time.perf_counter()
            with profiled(profile, args.profile, f"{impl}-tp{args.tp}"):
                result = engine.forward_backward(ids, num_tokens=global_token_count(ids, dp_group),
                                                 progress=_progress(t0) if rank == 0 else None)
                all_reduce_gradients(model, dp_group)
                if cuda:
                    torch.cuda.synchronize(device)
            dist.barrier()
            dt = time.perf_counter() - t0
            stats = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0, dt],
                                 dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            loss = result.loss.detach().clone()
            dist.all_reduce(loss, group=dp_group)
            if rank == 0:
                tokens = dp_size * length
                row = {"bench": "parallel", "impl": impl, "model": args.model, "world": world, "tp": args.tp,
                       "dp": dp_size, "seq_len": length, "layers": model.config.num_hidden_layers,
                       "chunk_size": args.chunk_size, "group_pages": args.group_pages, "offload": args.offload,
                       "kv_grad_dtype": args.kv_grad_dtype, "keep_attention": args.keep_attention,
                       "compile": args.compile,
                       "ok": True, "step_s": round(float(stats[1]), 3), "tok_s": round(tokens / float(stats[1]), 1),
                       "tok_s_per_gpu": round(tokens / float(stats[1]) / world, 1),
                       "peak_gib": round(float(stats[0]), 2) if cuda else None, "loss": round(float(loss), 4),
                       **({"profiled": True} if profile else {}), **info}
                record(args.out, row)
        del engine
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


def _progress(t0: float):
    """Rank 0 prints the chunk passes done about every 5 %, with the seconds since the step began
    (a step that outlasts its time limit still tells how far it got)."""
    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 20) == 0:
            print(f"  pass {done}/{total} at {time.perf_counter() - t0:.1f} s", flush=True)
    return report


if __name__ == "__main__":
    main()
