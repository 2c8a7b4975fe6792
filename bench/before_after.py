"""The same oomb step run by two source trees of the package, one process each: this checkout's
and an earlier commit's (`--before DIR`, a directory holding that commit's `src/`). Each tree
builds the same model (seed 0) and engine settings, reserves the length, warms up (with the
timed length's host layers, bench/common.warm_up), then times --repeats steps of the same tokens.
A row per tree: step seconds (each, and the median), peak GPU memory, the loss and a SHA-256 of
every trainable parameter's gradient after the last step; the second row says whether its
gradients are bitwise those of the first, and its median time against the first's. What a
refactor must keep: the step's time (within noise) and its gradients (bit for bit).

    git archive 991b9bd src | (mkdir -p .before && tar -x -C .before)    # the tree before
    python bench/before_after.py --before .before --lengths 64K --chunk-size 8192 --compile --keep-attention
    python bench/before_after.py --before .before --lengths 1M --sparse-budget 64 --offload auto \\
        --kv-grad-dtype bf16 --compile
    python bench/before_after.py --before .before --device cpu --model tiny --lengths 2K --chunk-size 256 \\
        --page-size 64 --backend torch          # on a CPU (the reference attention)

Rows go to --out (bench/results/before_after.jsonl), with the commit each tree is of (--before-commit;
this tree's from git or OOMB_COMMIT).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BENCH_LORA_TARGETS, record, run_info, warm_up, warm_up_tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def digests(model) -> dict[str, str]:
    """SHA-256 of each trainable parameter's gradient bytes (its dtype's bits, on the host)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            bits = p.grad.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha256(bits.tobytes()).hexdigest()
    return out


def worker(args) -> None:
    """One tree's measurement (run with PYTHONPATH=<tree>/src): prints one JSON line."""
    import oomb
    from oomb.presets import load_model

    where = os.path.dirname(os.path.realpath(oomb.__file__))
    assert where.startswith(os.path.realpath(args.tree)), f"imported oomb from {where}, not from {args.tree}"
    cuda = args.device == "cuda"
    torch.manual_seed(0)
    model = load_model(args.model, dtype=torch.bfloat16 if cuda else torch.float32, device=args.device)
    model.train()
    if args.lora_rank:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                           target_modules=list(BENCH_LORA_TARGETS)))
    engine = oomb.ChunkRecurrentEngine(
        model, chunk_size=args.chunk_size, page_size=args.page_size, backend=args.backend, offload=args.offload,
        sparse=oomb.TopKPages(budget=args.sparse_budget) if args.sparse_budget else None,
        kv_grad_dtype=torch.bfloat16 if args.kv_grad_dtype == "bf16" else torch.float32,
        checkpoint_layers=args.checkpoint_layers, compile_layers=args.compile,
        keep_attention=None if args.keep_attention else False,
        param_grad_dtype=torch.float32 if args.param_grad_dtype == "fp32" else None)
    length = args.length
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    ids = ids.to(args.device)
    engine.reserve(1, length)
    warm_up(engine, warm_up_tokens(length, args.chunk_size, args.page_size, engine.config.group_pages, 6))
    times, loss = [], None
    for _ in range(args.repeats):
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = float(engine.forward_backward(ids).loss)
        if cuda:
            torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 3))
    print(json.dumps({"step_s": times, "median_s": statistics.median(times), "loss": loss,
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                      "host_layers": len(engine.store.host_layers), "grads": digests(model)}), flush=True)


def settings(args) -> dict:
    keys = ("model", "lora_rank", "chunk_size", "page_size", "backend", "offload", "sparse_budget", "kv_grad_dtype",
            "checkpoint_layers", "compile", "keep_attention", "param_grad_dtype", "repeats", "device")
    return {k: getattr(args, k) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="a directory with the earlier tree's src/")
    parser.add_argument("--before-commit", default="", help="the commit --before holds (recorded in its row)")
    parser.add_argument("--lengths", default="64K")
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--offload", default="none", choices=("none", "all", "auto"))
    parser.add_argument("--sparse-budget", type=int, default=0)
    parser.add_argument("--kv-grad-dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--checkpoint-layers", action="store_true")
    parser.add_argument("--compile", action="store_true", help="compiled layers")
    parser.add_argument("--keep-attention", action="store_true", help="kept attention outputs, as far as they fit")
    parser.add_argument("--param-grad-dtype", default="param", choices=("param", "fp32"))
    parser.add_argument("--repeats", type=int, default=1, help="timed steps per tree (the median is compared)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=590.0, help="seconds for each tree's process")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "before_after.jsonl"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the tree a worker process measures
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.tree = args.worker
        worker(args)
        return
    if not args.before or not os.path.isdir(os.path.join(args.before, "src", "oomb")):
        sys.exit(f"--before {args.before!r} must be a directory holding an earlier tree's src/oomb "
                 "(git archive <commit> src | tar -x -C DIR)")
    from oomb.units import parse_tokens  # this checkout's (the workers import each tree's oomb)

    info = run_info()
    trees = [("before", os.path.abspath(args.before), args.before_commit or "unknown"), ("after", ROOT, info["commit"])]
    for length in map(parse_tokens, args.lengths.split(",")):
        first = None
        for name, tree, commit in trees:
            env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", tree, "--length", str(length),
                   *sys.argv[1:]]
            error, lines = None, []
            try:
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                if done.returncode or not lines:
                    sys.stderr.write(done.stderr[-4000:])
                    error = (done.stderr.strip().splitlines()[-1][:200] if done.stderr.strip()
                             else f"exit {done.returncode}")
            except subprocess.TimeoutExpired:
                error = f"timeout {args.timeout}s"
            if error:
                record(args.out, {"bench": "before_after", "tree": name, "seq_len": length, "ok": False,
                                  "error": error, **settings(args), **info, "commit": commit})
                break
            got = json.loads(lines[-1])
            grads = got.pop("grads")
            row = {"bench": "before_after", "tree": name, "seq_len": length, "ok": True, **settings(args), **got,
                   "grad_sha256": hashlib.sha256(json.dumps(grads, sort_keys=True).encode()).hexdigest(),
                   **info, "commit": commit}
            if first is None:
                first = (grads, got["median_s"])
            else:
                row["grads_equal_before"] = grads == first[0]
                row["differing_params"] = sorted(n for n in grads if grads[n] != first[0].get(n))[:5]
                row["time_vs_before"] = round(got["median_s"] / first[1], 4)
            record(args.out, row)


if __name__ == "__main__":
    main()
