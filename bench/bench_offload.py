"""Offload modes side by side on one Qwen2.5-7B-shaped model (random bf16 weights), one
process: step time and peak GPU memory of offload 'none' / 'all' / 'auto' (and of fp32 / bf16
dK/dV pages), and how each configuration's gradients compare with the first one's at the same
length: bitwise equal, and the largest relative error over the parameters.

    python bench/bench_offload.py --modes none,all --lengths 128K
    python bench/bench_offload.py --modes auto --kv-grad-dtypes fp32,bf16 --lengths 256K   # bf16 page error
    python bench/bench_offload.py --device cpu --model tiny --modes none --kv-grad-dtypes fp32,bf16 --lengths 8K

Rows go to --out (bench/results/step.jsonl: the step table shows them as oomb / oomb-all).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import record, run_info  # noqa: E402

import oomb  # noqa: E402
from oomb.presets import load_model  # noqa: E402
from oomb.units import parse_tokens  # noqa: E402

IMPL = {"none": "oomb", "all": "oomb-all", "auto": "oomb-auto"}
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compare(ref: dict, grads: dict) -> dict:
    """Bitwise equality, the whole gradient's relative error, and the parameter with the
    largest relative error (small gradients that are sums of cancelling terms, such as a
    k_proj bias's, show rounding the most)."""
    diff = {n: (grads[n].double() - ref[n].double()).norm().item() for n in ref}
    norm = {n: ref[n].double().norm().item() for n in ref}
    worst = max(ref, key=lambda n: diff[n] / max(norm[n], 1e-30))
    return {"grads_equal_first": all(torch.equal(grads[n], ref[n]) for n in ref),
            "grad_rel_err_vs_first": sum(d * d for d in diff.values()) ** 0.5 / sum(x * x for x in norm.values()) ** 0.5,
            "grad_max_rel_err_vs_first": diff[worst] / max(norm[worst], 1e-30), "grad_worst_param": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="none,all")
    ap.add_argument("--lengths", default="128K")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=None, help="default: the preset's")
    ap.add_argument("--model", default="qwen2.5-7b", help="a preset of oomb.presets")
    ap.add_argument("--device", default="cuda", help="cpu: float32 weights, torch attention (e.g. --model tiny)")
    ap.add_argument("--kv-grad-dtypes", default="fp32", help="fp32, bf16 or both (fp32,bf16)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step.jsonl"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_offload.py needs a CUDA GPU (or --device cpu --model tiny)")
    info = run_info()
    torch.manual_seed(0)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32, device=args.device,
                       **overrides).train()
    lengths = [parse_tokens(x) for x in args.lengths.split(",")]
    warm = torch.randint(0, model.config.vocab_size, (1, min(8192, min(lengths))), device=args.device)
    inputs = {n: torch.randint(0, model.config.vocab_size, (1, n), device=args.device) for n in lengths}
    reference = {}  # length -> the first mode's gradients, on the host
    configs = [(m, d) for m in args.modes.split(",") for d in args.kv_grad_dtypes.split(",")]
    for mode, grad_dtype in configs:
        # One engine at a time, so a mode's peak memory holds only its own pool.
        engine = oomb.ChunkRecurrentEngine(model, kernels=oomb.KernelOptions.from_env(os.environ),
                                           chunk_size=args.chunk_size, offload=mode, backend="auto",
                                           kv_grad_dtype=GRAD_DTYPES[grad_dtype])
        engine.forward_backward(warm)  # compile kernels, allocate grads
        engine.reserve(1, max(lengths))  # pool and pinned arena once, as a training run would
        for length in lengths:
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = float(engine.forward_backward(inputs[length]).loss)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            row = {"bench": "step", "impl": IMPL[mode], "model": args.model, "seq_len": length,
                   "layers": model.config.num_hidden_layers,
                   "chunk_size": args.chunk_size, "kv_grad_dtype": grad_dtype, "ok": True, "step_s": round(dt, 2), "tok_s": round(length / dt, 1),
                   "loss": round(loss, 4), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
            grads = {n: p.grad for n, p in model.named_parameters()}
            if length not in reference:
                reference[length] = {n: g.to("cpu") for n, g in grads.items()}
            else:
                row.update(compare(reference[length], {n: g.cpu() for n, g in grads.items()}))
            row.update(info)
            record(args.out, row)
        del engine
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
