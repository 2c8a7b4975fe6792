"""Does a model trained with oomb learn to use its context, and does top-k sparse attention hurt?

The same small byte-level model (the `byte-lm-30m` preset: Qwen2 shape, 31.7M parameters) trained
from scratch on the source code of installed packages (`oomb corpus`), with identical data order,
seed and steps, in several arms:

    dense-64k            dense attention, 64K-token sequences
    topk64-64k           top-k sparse attention, 64 pages (8K tokens) per query block
    topk16-64k           top-k, 16 pages
    base-8k              dense at 8K (8 sequences a step: the same tokens per step), the base of:
    ext-dense            base-8k extended to 64K by a larger RoPE base (--rope-theta), dense
    ext-topk64           the same extension trained with top-k 64
    ext-tail-dense       extension with loss on the last 4K tokens only (a long prompt, then the answer)
    ext-tail-topk64      the same with top-k 64
    ext-tail-topk64-d2   the same with the last two layers dense (the published fix)
and, when named in --arms: dense-64k-s1 and topk64-64k-s1 (another seed: the run-to-run spread),
topk64-minmax-64k (pages scored by their keys' min/max, Quest, instead of their mean), topk64-d01-64k
(the first two layers dense), topk128-64k (a larger budget) and topk64-sinks4-64k (4 sink pages).

Every arm's final model is then evaluated on held-out packages, with the attention it was trained
with and with the other (a top-k model read densely, a dense one read with top-k 64): loss by
position, key-value needle retrieval by length and depth, and top-k selection recall per layer.

    python bench/quality.py                          # the study (GPU), resumable, arms in parallel
    python bench/quality.py --smoke                  # every arm and evaluation, tiny, on CPU (CI)
    python bench/quality.py --report                 # docs/quality.md and its plots from the results

Resumable at two levels: an arm whose rows are already in the results file is skipped, and an arm
whose training was cut short resumes from its last checkpoint under --work (the same machine).
Rows go to --results (default bench/results/quality.jsonl): each training log line and each
evaluation, tagged with the arm, commit, date and hardware.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quality.jsonl"
DOC = HERE.parent / "docs" / "quality.md"


@dataclass
class Study:
    """The settings every arm shares (the full study; `smoke()` shrinks them)."""

    model: str = "byte-lm-30m"
    seq_len: int = 65536
    base_len: int = 8192
    chunk_size: int = 4096
    page_size: int = 128
    steps: int = 160  # from-scratch arms (tokens: steps x seq_len); what one H200 call of 10 minutes holds
    ext_steps: int = 40  # extension arms, from base-8k's final model
    lr: float = 1e-3
    ext_lr: float = 3e-4
    warmup: int = 15
    ext_warmup: int = 5
    weight_decay: float = 0.1
    ext_theta: float = 200_000.0  # base-8k trains with the preset's 10,000
    tail: int = 4096  # the tail arms' loss-carrying tokens
    needle_rate: float = 0.1
    needles_per_sequence: int = 16
    seed: int = 0
    save_every: int = 50
    eval_every: int = 50
    corpus_bytes: int = 300 * 2**20
    # evaluation
    eval_windows: int = 8
    lengths: tuple = (16384, 65536)
    depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    recall_chunks: int = 4
    recall_blocks: int = 4
    device: str = "auto"
    backend: str = "auto"
    budget_divisor: int = 1  # the smoke test's short sequences divide the arms' top-k budgets

    def pages(self, budget: int) -> int:
        """The top-k budget an arm's nominal one (its name's) stands for in these settings."""
        return max(1, budget // self.budget_divisor) if budget else 0


def smoke() -> Study:
    return Study(model="tiny", seq_len=1024, base_len=256, chunk_size=256, page_size=64, steps=2, ext_steps=2,
                 warmup=1, ext_warmup=1, tail=128, needle_rate=0.5, needles_per_sequence=2, save_every=1, eval_every=2,
                 corpus_bytes=2 * 2**20, eval_windows=1, lengths=(512, 1024), depths=(0.0, 1.0), samples=1,
                 recall_chunks=1, recall_blocks=1, device="cpu", backend="torch", budget_divisor=16)


@dataclass
class Arm:
    name: str
    what: str
    budget: int = 0  # top-k pages (0: dense)
    dense_layers: str = ""
    base: bool = False  # trained at base_len
    extends: str = ""  # starts from this arm's final model, with the extended RoPE base
    tail: bool = False  # loss on the last `tail` tokens only
    seed: int = 0  # added to the study's seed (weights and data order): a replicate
    representative: str = "mean"  # how top-k scores a page (TopKPages.representative)
    sinks: int = 1  # pages every query block attends (TopKPages.sink_pages)
    extra: bool = False  # a replicate or ablation: run when named in --arms (or --arms all)

    @property
    def attention(self) -> str:
        return label(self.budget, self.representative, self.sinks)

    def reads(self, budget: int) -> tuple[str, int]:
        """(representative, sink pages) of a top-k read at `budget`: the arm's own at its budget,
        plain top-k (mean, one sink page) otherwise."""
        return (self.representative, self.sinks) if budget == self.budget else ("mean", 1)


def label(budget: int, representative: str = "mean", sinks: int = 1) -> str:
    """How rows name an attention: dense, top-64, top-64-minmax, top-64-sinks4."""
    if not budget:
        return "dense"
    return (f"top-{budget}" + ("" if representative == "mean" else f"-{representative}")
            + ("" if sinks == 1 else f"-sinks{sinks}"))


ARMS = [
    Arm("dense-64k", "dense, from scratch"),
    Arm("topk64-64k", "top-k 64 pages, from scratch", budget=64),
    Arm("topk16-64k", "top-k 16 pages, from scratch", budget=16),
    Arm("base-8k", "dense at 8K, from scratch (the extension arms' base)", base=True),
    Arm("ext-dense", "8K -> 64K by RoPE base, dense", extends="base-8k"),
    Arm("ext-topk64", "8K -> 64K by RoPE base, top-k 64", budget=64, extends="base-8k"),
    Arm("ext-tail-dense", "extension, loss on the last tokens only, dense", extends="base-8k", tail=True),
    Arm("ext-tail-topk64", "extension, loss on the last tokens only, top-k 64", budget=64, extends="base-8k",
        tail=True),
    Arm("ext-tail-topk64-d2", "extension, loss on the last tokens only, top-k 64, last 2 layers dense", budget=64,
        dense_layers="-2,-1", extends="base-8k", tail=True),
    # replicates (another seed: the run-to-run spread) and an ablation of how top-k scores pages
    Arm("dense-64k-s1", "dense, from scratch, seed 1", seed=1, extra=True),
    Arm("topk64-64k-s1", "top-k 64 pages, from scratch, seed 1", budget=64, seed=1, extra=True),
    Arm("topk64-minmax-64k", "top-k 64 pages scored by min/max keys (Quest), from scratch", budget=64,
        representative="minmax", extra=True),
    Arm("topk64-d01-64k", "top-k 64 pages, the first two layers dense, from scratch", budget=64, dense_layers="0,1",
        extra=True),
    Arm("topk128-64k", "top-k 128 pages, from scratch", budget=128, extra=True),
    Arm("topk64-sinks4-64k", "top-k 64 pages of which the first 4 always, from scratch", budget=64, sinks=4,
        extra=True),
]
BY_NAME = {a.name: a for a in ARMS}
OTHER_BUDGET = 64  # a dense arm is also read with top-k 64


# -- data ------------------------------------------------------------------------------------

def corpus(study: Study, work: Path) -> Path:
    """The byte-level corpus of installed packages (built once per machine, under work/)."""
    from oomb.train.corpus import build_corpus

    out = work / "corpus"
    if not (out / "corpus.json").exists():
        summary = build_corpus(out, heldout=0.1, max_bytes=study.corpus_bytes, min_bytes=0)
        print(f"corpus: {summary['train']['tokens']:,} training bytes ({summary['train']['documents']} packages), "
              f"{summary['heldout']['tokens']:,} held-out ({summary['heldout']['documents']})", flush=True)
    return out


# -- one arm ---------------------------------------------------------------------------------

def train_config(arm: Arm, study: Study, work: Path, data: Path):
    from oomb.train.config import TrainConfig

    out = work / "arms" / arm.name
    seq_len = study.base_len if arm.base else study.seq_len
    batch = study.seq_len // study.base_len if arm.base else 1  # the same tokens per step
    steps = study.ext_steps if arm.extends else study.steps
    return TrainConfig(
        model=str(work / "arms" / arm.extends / "final") if arm.extends else study.model,
        data=str(data / "train.npy"), eval_data=str(data / "heldout.npy"), seq_len=seq_len, batch=batch,
        steps=steps, lr=study.ext_lr if arm.extends else study.lr,
        warmup_steps=study.ext_warmup if arm.extends else study.warmup,
        weight_decay=study.weight_decay, chunk_size=min(study.chunk_size, seq_len), page_size=study.page_size,
        sparse_budget=study.pages(arm.budget), sparse_dense_layers=arm.dense_layers,
        sparse_representative=arm.representative, sparse_sink_pages=arm.sinks,
        rope_theta=study.ext_theta if arm.extends else None, loss_last=study.tail if arm.tail else 0,
        needle_rate=study.needle_rate, needles_per_sequence=study.needles_per_sequence, tokenizer="bytes",
        output_dir=str(out), save_every=study.save_every, eval_every=study.eval_every, eval_batches=1,
        resume="auto", seed=study.seed + arm.seed, device=study.device,
        backend=study.backend)


def evaluations(arm: Arm) -> list[tuple[str, int, str]]:
    """(task, top-k budget or 0, dense layers) of every evaluation of an arm's final model:
    position-loss and retrieval with the attention the arm trained with and with the other (top-k
    read densely, dense read with top-k 64); selection recall at the arm's budget (64 for a dense
    arm) and, for another budget, at 64 too."""
    other = 0 if arm.budget else OTHER_BUDGET
    runs = [(task, budget, dense) for budget, dense in ((arm.budget, arm.dense_layers), (other, ""))
            for task in ("position-loss", "retrieval")]
    runs.append(("selection-recall", arm.budget or OTHER_BUDGET, arm.dense_layers))
    if arm.budget not in (0, OTHER_BUDGET):
        runs.append(("selection-recall", OTHER_BUDGET, ""))
    return runs


def evaluation_key(arm: Arm, task: str, budget: int, dense: str) -> tuple[str, str, str]:
    """How an evaluation's row is found again: (task, attention label, dense layers)."""
    return task, label(budget, *arm.reads(budget)), dense


def evaluated(name: str, rows: list[dict]) -> set[tuple[str, str, str]]:
    """The evaluation keys an arm's rows already hold."""
    return {(r.get("task"), r.get("attention"), r.get("dense_layers")) for r in rows
            if r.get("arm") == name and r.get("kind") == "eval"}


def evaluate(arm: Arm, study: Study, model, held, task: str, budget: int, dense: str) -> dict:
    """One evaluation of an arm's final model (loaded once per arm) on the held-out tokens."""
    import numpy as np

    from oomb import ChunkRecurrentEngine, TopKPages
    from oomb.eval import tasks
    from oomb.train.data import windows
    from oomb.train.needles import ByteCodec
    from oomb.train.trainer import parse_layers

    representative, sinks = arm.reads(budget)
    sparse = TopKPages(budget=study.pages(budget), dense_layers=parse_layers(dense), representative=representative,
                       sink_pages=min(sinks, study.pages(budget))) if budget else None
    engine = ChunkRecurrentEngine(model, chunk_size=study.chunk_size, page_size=study.page_size, sparse=sparse,
                                  kv_grad_dtype=None, backend=study.backend, offload="auto")
    t0 = time.perf_counter()
    if task == "position-loss":
        result = tasks.position_loss(engine, windows(held, study.seq_len, 1, study.eval_windows), study.seq_len)
    elif task == "retrieval":
        result = tasks.retrieval(engine, np.asarray(held), ByteCodec(), list(study.lengths), list(study.depths),
                                 study.samples, seed=study.seed)
    else:
        result = tasks.selection_recall(engine, windows(held, study.seq_len, 1, 1), study.seq_len,
                                        study.recall_chunks, study.recall_blocks, study.seed)
        result.pop("samples")
    return {**result, "eval_s": round(time.perf_counter() - t0, 1),
            "attention": evaluation_key(arm, task, budget, dense)[1], "dense_layers": dense}


def run_arm(name: str, study: Study, work: Path, rows_file: Path, info: dict) -> None:
    """Train the arm (or resume it) and evaluate its final model; rows appended to rows_file."""
    from oomb.train.trainer import train

    arm = BY_NAME[name]
    data = corpus(study, work)
    out = work / "arms" / name
    done = evaluated(name, read_rows(rows_file))
    if not (out / "final" / "config.json").exists():
        cfg = train_config(arm, study, work, data)
        t0 = time.perf_counter()
        train(cfg)
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        append(rows_file, [{"study": "quality", "arm": name, "kind": "train", **r, **info} for r in steps]
               + [{"study": "quality", "arm": name, "kind": "trained", "train_s": round(time.perf_counter() - t0, 1),
                   "config": dataclasses.asdict(cfg), **info}])
    todo = [e for e in evaluations(arm) if evaluation_key(arm, *e) not in done]
    if not todo:
        return
    import torch

    from oomb.presets import load_model
    from oomb.train.data import open_tokens
    from oomb.train.trainer import resolve_device

    device = resolve_device(study.device)
    model = load_model(str(out / "final"), device=device,
                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    held = open_tokens(data / "heldout.npy", model.config.vocab_size)
    for task, budget, dense in todo:
        r = evaluate(arm, study, model, held, task, budget, dense)
        append(rows_file, [{"study": "quality", "arm": name, "kind": "eval", "trained_with": arm.attention,
                            "trained_dense_layers": arm.dense_layers, **r, **info}])


# -- results ---------------------------------------------------------------------------------

def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(path: Path, rows: list[dict]) -> None:
    """Each row one write of one line to a file opened for appending, so the arms running at once
    never interleave their rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for r in rows:
            os.write(fd, (json.dumps(r) + "\n").encode())
    finally:
        os.close(fd)


def complete(name: str, rows: list[dict]) -> bool:
    arm = BY_NAME[name]
    return {evaluation_key(arm, *e) for e in evaluations(arm)} <= evaluated(name, rows)


# -- the study: arms in parallel, dependencies first -----------------------------------------

def run_study(study: Study, names: list[str], work: Path, results: Path, jobs: int, deadline: float) -> None:
    from common import run_info

    info = run_info()
    info["setting"] = "smoke" if study.model == "tiny" else "full"
    work.mkdir(parents=True, exist_ok=True)
    corpus(study, work)  # once, before the arms start
    todo = [n for n in names if not complete(n, read_rows(results))]
    print(f"quality study: {len(names) - len(todo)} of {len(names)} arms already in {results}; running "
          f"{', '.join(todo) or 'none'}", flush=True)
    start = time.perf_counter()
    if jobs == 0:  # in this process, one after another (the CPU smoke test)
        for n in _ordered(todo):
            run_arm(n, study, work, results, info)
        return
    running: dict[str, subprocess.Popen] = {}
    waiting = _ordered(todo)
    failed: list[str] = []
    env = {**os.environ, "OOMB_QUALITY": json.dumps({"study": dataclasses.asdict(study), "info": info})}

    def elapsed() -> str:
        return f"[{time.perf_counter() - start:7.0f}s]"

    while waiting or running:
        for n, p in list(running.items()):
            if p.poll() is not None:
                del running[n]
                if p.returncode:
                    failed.append(n)
                print(f"{elapsed()} {n}: {'FAILED' if p.returncode else 'done'}", flush=True)
        for n in [n for n in waiting if BY_NAME[n].extends in failed]:  # its base failed: it cannot start
            waiting.remove(n)
            failed.append(n)
        late = time.perf_counter() - start >= deadline
        for n in [n for n in waiting if _ready(n, work)]:
            if len(running) >= jobs or late:
                break
            waiting.remove(n)
            log = open(work / f"{n}.log", "a")
            cmd = [sys.executable, __file__, "--arm", n, "--work", str(work), "--results", str(results)]
            running[n] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"{elapsed()} {n}: started", flush=True)
        if late and not running:
            break
        time.sleep(2)
    if failed or waiting:
        print(f"quality study: not finished: failed {failed}, not started {waiting} (see {work}/<arm>.log)",
              flush=True)


def _ordered(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (bool(BY_NAME[n].extends), ARMS.index(BY_NAME[n])))


def _ready(name: str, work: Path) -> bool:
    base = BY_NAME[name].extends
    return not base or (work / "arms" / base / "final" / "config.json").exists()


# -- report ----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny settings on the CPU (every arm, in-process)")
    parser.add_argument("--arms", default="", help="comma-separated arms (default: the study's, without the extra "
                                                   "replicates and ablations; 'all': every arm)")
    parser.add_argument("--arm", default="", help=argparse.SUPPRESS)  # one arm, in a child process
    parser.add_argument("--work", default="runs/quality", help="checkpoints, corpus and logs")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--jobs", type=int, default=len(ARMS), help="arms at once (0: in this process)")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="start no arm after this many seconds")
    parser.add_argument("--steps", type=int, default=0, help="override the from-scratch arms' steps")
    parser.add_argument("--ext-steps", type=int, default=0, help="override the extension arms' steps")
    parser.add_argument("--report", action="store_true", help="write docs/quality.md and its plots from --results")
    parser.add_argument("--doc", default=str(DOC), help="the page --report writes (its plots beside it)")
    args = parser.parse_args()
    study = smoke() if args.smoke else Study()
    if args.steps:
        study.steps = args.steps
    if args.ext_steps:
        study.ext_steps = args.ext_steps
    work, results = Path(args.work), Path(args.results)
    if args.report:
        from quality_report import write_report
        write_report(read_rows(results), Path(args.doc))
        return
    if args.arm:  # a child of run_study: the parent's settings and run information
        given = json.loads(os.environ["OOMB_QUALITY"])
        run_arm(args.arm, Study(**given["study"]), work, results, given["info"])
        return
    names = [n.strip() for n in args.arms.split(",") if n.strip()] or [a.name for a in ARMS if not a.extra]
    if names == ["all"]:
        names = [a.name for a in ARMS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        sys.exit(f"quality.py: unknown arm {unknown[0]!r}; arms: {', '.join(BY_NAME)}")
    for n in names:
        base = BY_NAME[n].extends
        if base and base not in names and not (work / "arms" / base / "final" / "config.json").exists():
            sys.exit(f"quality.py: arm {n} starts from {base}'s final model: add {base} to --arms")
    run_study(study, names, work, results, 0 if args.smoke else args.jobs, args.deadline)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
