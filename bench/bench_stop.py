"""What the stop agreement costs (train/interrupt.py): under torch.distributed every rank
all-reduces a stop flag (one int32, on the host through gloo) after each chunk pass, so that a
SIGTERM abandons the step at the same chunk boundary on all ranks. Measured under torchrun:
the flag's all-reduce alone (--reps calls back to back), and training steps (forward +
backward + the gradient all-reduce, no optimizer) of a preset model with the agreement in the
engine's progress callback and without, alternated --repeats times; per chunk pass, the
difference of the medians is what a run pays.

    torchrun --nproc-per-node 2 bench/bench_stop.py --device cpu      # gloo, 2 CPU processes
    torchrun --nproc-per-node 8 bench/bench_stop.py --model qwen2.5-7b --seq-len 64K --chunk-size 4096

Rank 0 appends one JSON line to --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info, torchrun_device  # noqa: E402

import oomb  # noqa: E402
from oomb.parallel import all_reduce_gradients, global_token_count, host_group, init_distributed  # noqa: E402
from oomb.presets import load_model  # noqa: E402
from oomb.train.interrupt import Interrupt  # noqa: E402
from oomb.units import parse_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=parse_tokens, default=4096)
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="steps with the agreement and without, alternated")
    ap.add_argument("--reps", type=int, default=2000, help="flag all-reduces timed back to back")
    ap.add_argument("--device", default="cuda", help="cpu: gloo, CPU processes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "stop.jsonl"))
    args = ap.parse_args()
    cuda = torchrun_device(args.device, "torchrun --nproc-per-node 2 bench/bench_stop.py --device cpu",
                           "or --device cpu: gloo on CPU processes")
    mesh = init_distributed()
    dp_group, group = mesh["dp"].get_group(), host_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    interrupt = Interrupt(announce=False)  # no signal comes: the flag stays 0, as in a run's every chunk

    def agree(done: int, total: int) -> None:
        interrupt.agreed(group)

    for _ in range(100):  # gloo's connections warm
        interrupt.agreed(group)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        interrupt.agreed(group)
    allreduce_us = 1e6 * (time.perf_counter() - t0) / args.reps

    torch.manual_seed(0)  # the same weights on every rank
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    model.train()
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=args.chunk_size, page_size=args.page_size)
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=gen).to(device)
    count = global_token_count(ids, dp_group)

    def step(progress) -> float:
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        engine.forward_backward(ids, num_tokens=count, progress=progress)
        all_reduce_gradients(model, dp_group)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    step(None)  # warm-up: gradients allocated, kernels compiled
    times = {"without": [], "with": []}
    for _ in range(args.repeats):
        times["without"].append(step(None))
        times["with"].append(step(agree))
    interrupt.restore()
    passes = 2 * -(-args.seq_len // engine.chunk_size) - 1
    median = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        record(args.out, {"bench": "stop", "model": args.model, "device": args.device, "world": world,
                          "seq_len": args.seq_len, "chunk_size": engine.chunk_size, "passes": passes,
                          "repeats": args.repeats, "allreduce_us": round(allreduce_us, 1),
                          "step_s_without": round(median["without"], 3), "step_s_with": round(median["with"], 3),
                          "pass_ms_without": round(1e3 * median["without"] / passes, 2),
                          "pass_ms_with": round(1e3 * median["with"] / passes, 2),
                          "cost_per_pass_us": round(1e6 * (median["with"] - median["without"]) / passes, 1),
                          **run_info()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
