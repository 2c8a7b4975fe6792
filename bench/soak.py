"""Soak: does memory stay flat over many steps of the real trainer (`oomb train`)?

Runs `python -m oomb.cli train` in a child process, reads the GPU allocated / reserved, host
resident set and pinned GiB it writes to <out-dir>/metrics.jsonl after every step, and appends
one row per run to --results: the per-step series, each series' growth and the verdict.

    # H200, 1M tokens, top-k 64, offload auto with some layers' pages on the host (the trainer
    # sees 32 GiB free: this process holds the rest of the GPU); a step estimated at 20-35 s:
    OOMB_COMMIT=<sha> python bench/soak.py --model qwen2.5-0.5b --seq-len 1M --sparse-budget 64 \\
        --offload auto --gpu-free-gib 32 --steps 10 --budget-s 420 --results $OUT/soak.jsonl
    # H200, 256K dense, 20 steps (head_dim 128: dense pages take Hopper's fused backward); ~5-10 s a step:
    OOMB_COMMIT=<sha> python bench/soak.py --model byte-lm-30m --seq-len 256K --offload none \\
        --steps 20 --budget-s 420 --results $OUT/soak.jsonl
    # CPU: the whole pipeline on the tiny preset (tests/test_soak.py)
    python bench/soak.py --smoke --results /tmp/soak.jsonl

Flat (analyse()): in each series, the baseline is the value after the run's second step (the
first compiles kernels, creates the optimizer state and fills the caching allocator); growth is
the largest value after it less the baseline. A series is flat when growth <= max(1 % of its
baseline, 0.01 GiB) (--tolerance-pct, --floor-gib: 10 MiB is below a resident set's noise);
the run passes when every series is flat and at least one step followed the baseline. --smoke
raises the floor to 0.1 GiB: on a CPU the resident set holds the activations, and it moved by up to
50 MiB between steps of a flat run (2 cores, 2026-12-04).

Chaining: --budget-s stops the trainer (SIGTERM: it checkpoints its last finished step) as soon
as the next step would end past that many seconds from the start; run the same command with
--resume to continue from <out-dir>'s last checkpoint (on a machine that kept the directory).
Each run is one row, analysed on its own steps (a new process has a new baseline). Leave the
command a minute beyond --budget-s for the checkpoint and export written at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))  # this tree's oomb
from common import logged_steps, record, run_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERIES = ("gpu_alloc_gib", "gpu_reserved_gib", "host_rss_gib", "pinned_gib")


def analyse(rows: list[dict], baseline_step: int = 2, tolerance_pct: float = 1.0, floor_gib: float = 0.01) -> dict:
    """{"checks": {series: baseline, max, growth, slope, ok}, "flat": bool or None (too few
    steps)}: see the module docstring. baseline_step counts this run's steps from 1."""
    checks, i = {}, baseline_step - 1
    for name in SERIES:
        values = [r[name] for r in rows if name in r]
        if len(values) != len(rows) or len(values) < i + 2:  # absent (CPU: no GPU series) or too few steps
            continue
        base, later = values[i], values[i + 1:]
        growth = max(later) - base
        xs = range(len(values) - i)  # least-squares slope from the baseline on: a steady leak's rate
        mean_x, mean_y = sum(xs) / len(xs), sum(values[i:]) / len(xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values[i:])) / sum((x - mean_x) ** 2 for x in xs)
        checks[name] = {"baseline_gib": base, "max_gib": max(later), "growth_gib": round(growth, 4),
                        "growth_pct": round(100 * growth / base, 3) if base else None,
                        "slope_gib_per_step": round(slope, 5),
                        "ok": growth <= max(tolerance_pct / 100 * base, floor_gib)}
    return {"checks": checks, "flat": all(c["ok"] for c in checks.values()) if checks else None}


def train_command(args, resume) -> list[str]:
    cmd = [sys.executable, "-m", "oomb.cli", "train", "--model", args.model, "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--chunk-size", str(args.chunk_size), "--offload", args.offload,
           "--sparse-budget", str(args.sparse_budget), "--output-dir", args.out_dir, "--log-every", "1"]
    if args.smoke:
        cmd += ["--device", "cpu"]
    # a fresh run replaces what an earlier one left in --out-dir (the trainer refuses it otherwise)
    cmd += ["--resume", str(resume)] if resume else ["--overwrite"]
    return cmd + args.train_args


def hold_gpu(free_gib: float | None):
    """A tensor holding all but `free_gib` of the GPU's free memory (None: nothing held), so that
    offload 'auto' in the trainer finds that much and puts the pages that do not fit on the host."""
    if free_gib is None:
        return None
    import torch

    free, _ = torch.cuda.mem_get_info()
    hold = free - int(free_gib * 2**30)
    if hold <= 0:
        print(f"soak: the GPU has {free / 2**30:.1f} GiB free, not more than --gpu-free-gib {free_gib}: nothing held")
        return None
    return torch.empty(hold, dtype=torch.uint8, device="cuda")


def run(args) -> tuple[list[dict], str, int, float]:
    """Runs the trainer; (this run's step rows, how it stopped, its exit code, seconds)."""
    metrics = os.path.join(args.out_dir, "metrics.jsonl")
    os.makedirs(args.out_dir, exist_ok=True)
    from oomb.train import checkpoint
    from oomb.train.output_dir import truncate_metrics

    resume = checkpoint.latest(args.out_dir) if args.resume else None
    if args.resume and resume is None:
        print(f"soak: no checkpoint in {args.out_dir}: starting from step 0")
    known = 0  # the lines before this run's: a fresh run (--overwrite) has none
    if resume:  # what the trainer keeps (the rows up to its step), dropped here before it starts
        truncate_metrics(metrics, json.loads((resume / "trainer.json").read_text())["step"])
        known = len(open(metrics).read().splitlines()) if os.path.exists(metrics) else 0
    cmd = train_command(args, resume)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    print("soak:", shlex.join(cmd), flush=True)
    start, signalled, rows, stopped = time.time(), None, [], "done"
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    while True:
        try:
            proc.wait(timeout=2)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        lines = open(metrics).read().splitlines()[known:] if os.path.exists(metrics) else []
        new = logged_steps(lines)
        for r in new[len(rows):]:
            print(f"soak: step {r['step']}: " + ", ".join(f"{k} {r[k]}" for k in SERIES if k in r), flush=True)
        rows = new
        if finished:
            break
        elapsed = time.time() - start
        if args.budget_s and signalled is None:
            next_end = elapsed + (1.2 * rows[-1]["step_s"] if rows else 0)
            if next_end > args.budget_s and (not rows or rows[-1]["step"] < args.steps):
                print(f"soak: {elapsed:.0f} s: the next step would end past --budget-s {args.budget_s}: "
                      "SIGTERM (the trainer checkpoints its last finished step)", flush=True)
                proc.send_signal(signal.SIGTERM)
                signalled, stopped = time.time(), "budget"
        elif signalled is not None and time.time() - signalled > args.grace_s:
            print(f"soak: the trainer did not stop within {args.grace_s} s of SIGTERM: killed", flush=True)
            proc.kill()
            signalled = float("inf")
    rc = proc.returncode
    if rc != 0 and stopped != "budget":
        stopped = f"failed (exit {rc})"
    return rows, stopped, rc, time.time() - start


def main(argv: list[str] | None = None) -> int:
    from oomb.units import parse_tokens

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="a preset of oomb.presets (or a checkpoint directory)")
    ap.add_argument("--seq-len", default="256K")
    ap.add_argument("--steps", type=int, default=20, help="the trainer's --steps (a resumed run: the total)")
    ap.add_argument("--sparse-budget", type=int, default=0, help="> 0: top-k sparse attention over this many pages")
    ap.add_argument("--offload", default="auto", choices=["none", "all", "auto"])
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--gpu-free-gib", type=float, default=None,
                    help="hold all but this much of the GPU's free memory while the trainer runs (offload auto "
                         "then puts the pages that do not fit on the host: a small model's would all fit)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop (with a checkpoint) before this many seconds")
    ap.add_argument("--grace-s", type=float, default=180, help="seconds the trainer gets to stop after SIGTERM")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out-dir")
    ap.add_argument("--out-dir", default=None, help="the trainer's --output-dir (default runs/soak/<run>)")
    ap.add_argument("--results", default=os.path.join(ROOT, "bench", "results", "soak.jsonl"))
    ap.add_argument("--baseline-step", type=int, default=2, help="the step whose memory the later ones are held to")
    ap.add_argument("--tolerance-pct", type=float, default=1.0)
    ap.add_argument("--floor-gib", type=float, default=0.01)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: tiny preset, 1K tokens, 4 steps, top-k, offload all, --floor-gib 0.1")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then more `oomb train` flags")
    if "--smoke" in (argv if argv is not None else sys.argv[1:]):  # its defaults; flags given still count
        ap.set_defaults(model="tiny", seq_len="1K", steps=4, chunk_size=256, sparse_budget=2, offload="all",
                        floor_gib=0.1)  # a CPU resident set moves by up to 50 MiB between steps (activations)
    args = ap.parse_args(argv)
    args.train_args = [a for a in args.train_args if a != "--"]
    args.seq_len = parse_tokens(args.seq_len)
    mode = (f"top-k {args.sparse_budget}" if args.sparse_budget else "dense") + f", offload {args.offload}"
    name = f"{args.model}-{args.seq_len}-{'topk' if args.sparse_budget else 'dense'}-{args.offload}"
    args.out_dir = args.out_dir or os.path.join(ROOT, "runs", "soak", name)

    held = hold_gpu(args.gpu_free_gib)
    rows, stopped, rc, wall_s = run(args)
    del held
    verdict = analyse(rows, args.baseline_step, args.tolerance_pct, args.floor_gib)
    row = {"bench": "soak", "model": args.model, "seq_len": args.seq_len, "mode": mode,
           "sparse_budget": args.sparse_budget, "offload": args.offload, "chunk_size": args.chunk_size,
           "gpu_free_gib": args.gpu_free_gib, "host_layers": rows[-1].get("host_layers") if rows else None,
           "target_steps": args.steps, "steps": len(rows), "first_step": rows[0]["step"] if rows else None,
           "last_step": rows[-1]["step"] if rows else None, "stopped": stopped, "returncode": rc,
           "wall_s": round(wall_s, 1), "step_s": [r["step_s"] for r in rows],
           "series": {k: [r[k] for r in rows] for k in SERIES if rows and all(k in r for r in rows)},
           "baseline_step": args.baseline_step, "tolerance_pct": args.tolerance_pct, "floor_gib": args.floor_gib,
           "growth": verdict["checks"], "flat": verdict["flat"], "cpus": os.cpu_count(),
           "host_mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
           "command": shlex.join(["python", os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:])),
           "train_command": shlex.join(["oomb", *train_command(args, None)[3:]]), **run_info()}
    record(args.results, row)
    print(f"\nsoak: {args.model}, {args.seq_len:,} tokens, {mode}: {len(rows)} steps ({stopped}), "
          f"host layers {row['host_layers']}, {wall_s:.0f} s")
    for name, c in verdict["checks"].items():
        pct = f"{c['growth_pct']:+.3f} %" if c["growth_pct"] is not None else "-"
        print(f"  {name:<17} baseline {c['baseline_gib']:8.3f}  max {c['max_gib']:8.3f}  growth {c['growth_gib']:+.4f} "
              f"GiB ({pct})  slope {c['slope_gib_per_step']:+.5f} GiB/step  {'flat' if c['ok'] else 'GROWS'}")
    print(f"soak: {'PASS' if verdict['flat'] else 'FAIL' if verdict['flat'] is False else 'too few steps'} "
          f"-> {args.results}")
    if stopped.startswith("failed"):
        return 2
    return 0 if verdict["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
