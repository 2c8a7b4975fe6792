"""One training step (forward + backward, no optimizer) of a small preset on the CPU: oomb's
torch backend (the engine `oomb train` builds) against transformers' full-sequence step (SDPA,
no gradient checkpointing), both in this process, alternating, a few repeats each;
oomb-reference is oomb with every attention group in the materialised reference
(OOMB_CPU_FLASH=0), the torch backend before its fused CPU path. A shared machine's wall times are noisy:
each row gives the fastest and the median wall time, and the process CPU time of the fastest
(both threads' seconds: what other processes on the machine disturb least).

    python bench/bench_cpu_step.py                      # tiny preset, 4,096 tokens, oomb train's chunk
    python bench/bench_cpu_step.py --lengths 4096,16384 --repeats 5
    python bench/bench_cpu_step.py --impls oomb,oomb-reference,hf

Prints one JSON line per (impl, length); --out also appends them to a file.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

import oomb  # noqa: E402
from oomb.presets import load_model  # noqa: E402
from oomb.train.config import TrainConfig  # noqa: E402
from oomb.train.trainer import make_optimizer, run_engine_config  # noqa: E402
from oomb.units import parse_tokens  # noqa: E402


def main() -> None:
    defaults = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=defaults.model)
    ap.add_argument("--lengths", default=str(defaults.seq_len))
    ap.add_argument("--chunk-size", default=str(defaults.chunk_size),
                    help="tokens, or auto (oomb train's choice for each length, oomb.auto)")
    ap.add_argument("--page-size", type=int, default=defaults.page_size)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", default="oomb,hf", help="oomb, oomb-reference, hf")
    ap.add_argument("--out", default="", help="a results file to append the rows to (default: print only)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model)
    model.config._attn_implementation = "sdpa"
    model.train()
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], defaults)  # no state yet
    engines = {}

    def engine_for(length: int, reference: bool) -> oomb.ChunkRecurrentEngine:
        """The engine oomb train builds for `length` (TrainConfig's defaults, --chunk-size,
        --page-size); the reference: the same with every attention group materialised."""
        if length not in engines:
            cfg = TrainConfig(model=args.model, seq_len=length, chunk_size=args.chunk_size, page_size=args.page_size)
            settings, _ = run_engine_config(cfg, model, torch.device("cpu"), optimizer)
            engines[length] = (oomb.ChunkRecurrentEngine(model, settings), oomb.ChunkRecurrentEngine(
                model, settings.replace(kernels=oomb.KernelOptions(cpu_flash=False))))
        return engines[length][reference]

    def hf_step(ids):
        model(input_ids=ids, labels=ids).loss.backward()

    def oomb_step(ids):
        engine_for(ids.shape[1], False).forward_backward(ids)

    def reference_step(ids):
        engine_for(ids.shape[1], True).forward_backward(ids)

    impls = {"oomb": oomb_step, "oomb-reference": reference_step, "hf": hf_step}
    steps = {name: impls[name] for name in args.impls.split(",")}
    info = run_info()
    vocab = model.config.vocab_size
    for length in map(parse_tokens, args.lengths.split(",")):
        ids = torch.randint(0, vocab, (1, length))
        times = {name: [] for name in steps}  # (wall s, process CPU s) of each repeat
        for name, step in steps.items():  # warm-up
            step(ids)
            model.zero_grad(set_to_none=True)
        for _ in range(args.repeats):
            for name, step in steps.items():
                t0, c0 = time.perf_counter(), time.process_time()
                step(ids)
                times[name].append((time.perf_counter() - t0, time.process_time() - c0))
                model.zero_grad(set_to_none=True)
        for name in steps:
            row = {"bench": "cpu_step", "impl": name, "model": args.model, "seq_len": length,
                   "chunk_size": engine_for(length, False).chunk_size if name.startswith("oomb") else None,
                   "threads": torch.get_num_threads(),
                   "step_s": round(min(times[name])[0], 3), "cpu_s": round(min(times[name])[1], 3),
                   "median_s": round(statistics.median(t for t, _ in times[name]), 3),
                   "all_s": [round(t, 3) for t, _ in times[name]], **info}
            if args.out:
                record(args.out, row)
            else:
                print(row, flush=True)
        best = {name: min(times[name]) for name in steps}
        base = best.get("hf")
        print(f"{length} tokens, fastest of {args.repeats}: " + ", ".join(
            f"{name} {t:.2f} s" + (f" ({t / base[0]:.2f}x wall, {c / base[1]:.2f}x CPU time of hf)"
                                   if base and name != "hf" else "")
            for name, (t, c) in best.items()), flush=True)


if __name__ == "__main__":
    main()
