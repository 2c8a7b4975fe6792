"""Does top-k sparse training keep long-range retrieval? Associative recall in real text, dense
training as the positive control, top-k measured against it.

The task (src/oomb/data/recall.py): single-token keys and values from ids reserved above the
bytes of the `byte-kv-30m` preset (byte-lm-30m's shape: Qwen2, 10 layers, head_dim 128), hidden in
the source code of installed packages (`oomb corpus`), each queried once later in the sequence;
the value after a query is chance (1/256) without attending to its needle. Every arm is trained
with `oomb train`'s own trainer and read with `oomb eval`'s kv-recall task.

    base-128         dense, 128-token sequences from scratch (512 a step, 12 pairs each): the
                     best of a race of designs (RACE), where recall is discovered
    base-1k          then 1K-token sequences (64 a step, 96 pairs each)
    base-4k          then 4K-token sequences (16 a step, 256 pairs each)
    base-16k         then 16K-token sequences (4 a step, 256 pairs each), each stage at a constant
                     learning rate from the one before's final model
and from base-16k's final model, 64K sequences with 256 pairs each, the same data order:
    dense-64k        dense attention (the positive control)
    topk64-64k       top-k sparse attention, 64 pages (8K tokens) per query block
    topk16-64k       top-k, 16 pages
    topk16-d01-64k   top-k 16 with layers 0 and 1 dense
    neg-64k          top-k with a budget of one page, the sink: sees its own chunk and the first
                     page only (the negative control: must fall to chance beyond its chunk)
and, when named in --arms (or 'all'): dense-64k-s1 and topk64-64k-s1 (another data order: the
run-to-run spread).

Every arm's final model is read with kv-recall (256 queries in each distance bucket: same chunk,
then 0-4K, 4-16K, 16-32K and 32-64K between chunks, 95 % Wilson intervals; top-k reads also give
the needle-page hit rate per layer and KV head) with its own attention and with the other (a
top-k model read densely, a dense one read with top-k 64: the training-free setting), and its
held-out loss.

    python bench/quality.py                          # the study (GPU), resumable, arms in parallel
    python bench/quality.py --smoke                  # every arm and evaluation, tiny, on CPU (CI)
    python bench/quality.py --report                 # docs/quality.md and its plots from the results

Resumable at two levels: an arm whose rows are already in the results file is skipped, and an arm
whose training was cut short resumes from its last checkpoint under --work (the same machine).
Across machines (device calls that do not share a disk): `--handoff DIR` writes each trained arm's
final model into DIR as bf16 shards of at most 15 MB, and takes the arms found there, so their
dependents start from them.
Rows go to --results (default bench/results/quality.jsonl), tagged "study": "recall": each
training log line and each evaluation, with the arm, commit, date and hardware.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quality.jsonl"
DOC = HERE.parent / "docs" / "quality.md"
STUDY = "recall"


@dataclass(frozen=True)
class Stage:
    """One stage of the dense curriculum that every 64K arm starts from (recall is discovered where
    sequences are short, then carried to longer ones: docs/quality.md's pilot)."""

    seq_len: int
    batch: int
    pairs: int  # recall pairs per training sequence
    steps: int
    lr: float
    warmup: int
    seconds: float = float("inf")  # a time box: the stage stops after this long (then the gate decides)


STAGES = ("base-128", "base-1k", "base-4k", "base-16k")  # in order; each starts from the one before's final model


@dataclass(frozen=True)
class Design:
    """An entrant of the race that makes base-128: a model and recipe for 128-token sequences, from
    scratch. The entrants train at once, each until its held-out recall reaches Study.stage_target
    or Study.race_seconds pass; the one with the best last recall becomes base-128."""

    name: str
    model: str
    lr: float
    batch: int = 512
    pairs: int = 12  # recall pairs per sequence
    seq_len: int = 128
    warmup: int = 200


# A race of five designs (byte-kv-30m at lr 1e-3 and 5e-4, byte-kv-2l at 3e-3 and 1e-3, byte-kv-4l at
# 2e-3) all reached 0.95 (H200, ed3a83f, docs/quality.md); the 4-layer model first, in 750 steps, so
# the study runs it alone
RACE = (Design("4l-2e-3", "byte-kv-4l", 2e-3),)


@dataclass
class Study:
    """The settings every arm shares (the full study; `smoke()` shrinks them)."""

    model: str = "byte-kv-30m"
    rope_theta: float = 5e6  # a base that serves 64K ("Base of RoPE bounds context length")
    short_rope_theta: float = 1e4  # a short-context model's (serves ~2K-4K): the extension arms' start
    recall_keys: int = 256
    recall_values: int = 256
    # the curriculum (STAGES), each at a constant learning rate after its warm-up
    # base-128 is the race's winner (RACE) when `race` is not empty, else stages[0] from scratch
    stages: tuple = (Stage(128, 128, 12, 6000, 1e-3, 100), Stage(1024, 64, 96, 3000, 5e-4, 50, 240),
                     Stage(4096, 16, 256, 1500, 3e-4, 50, 240), Stage(16384, 4, 256, 1500, 3e-4, 50, 240))
    race: tuple = RACE
    race_seconds: float = 420.0
    race_steps: int = 100_000  # the race's entrants stop by recall or time, not by steps
    # a stage or entrant stops early once its held-out recall (the mean over its distance buckets)
    # reaches this
    stage_target: float = 0.95
    seq_len: int = 65536  # the arms
    chunk_size: int = 4096
    page_size: int = 128
    steps: int = 200
    lr: float = 3e-4
    warmup: int = 10
    pairs: int = 256
    weight_decay: float = 0.1
    seed: int = 0
    save_every: int = 50
    stage_eval_every: int = 100
    # a stage whose last held-out recall (the mean over its distance buckets) is below this does not
    # hand on: the stages and arms built on it are not started (the budget is not spent on a base that
    # has not learnt the task)
    stage_gate: float = 0.9
    eval_every: int = 25
    eval_batches: int = 2
    corpus_bytes: int = 300 * 2**20
    # evaluation
    edges: tuple = (0, 4096, 16384, 32768, 65536)
    queries: int = 256  # per distance bucket
    eval_pairs: int = 64  # per evaluation sequence
    loss_windows: int = 4  # held-out windows of seq_len for the loss
    device: str = "auto"
    backend: str = "auto"
    budget_divisor: int = 1  # the smoke test's short sequences divide the arms' top-k budgets

    def __post_init__(self) -> None:
        self.stages = tuple(Stage(**s) if isinstance(s, dict) else s for s in self.stages)  # from a child's JSON
        self.race = tuple(Design(**d) if isinstance(d, dict) else d for d in self.race)
        if len(self.stages) != len(STAGES):
            raise ValueError(f"{len(self.stages)} stages for the curriculum {STAGES}")

    def stage(self, name: str) -> Stage:
        return self.stages[STAGES.index(name)]

    def pages(self, budget: int) -> int:
        """The top-k budget an arm's nominal one (its name's) stands for in these settings."""
        return max(1, budget // self.budget_divisor) if budget else 0


def smoke() -> Study:
    return Study(model="tiny-kv", recall_keys=32, recall_values=32,
                 stages=(Stage(64, 2, 4, 2, 1e-3, 1), Stage(128, 2, 8, 2, 1e-3, 1), Stage(256, 2, 8, 2, 1e-3, 1),
                         Stage(512, 1, 8, 2, 1e-3, 1)),
                 race=(Design("a", "tiny-kv", 1e-3, batch=2, pairs=4, seq_len=64, warmup=1),
                       Design("b", "tiny-kv", 3e-3, batch=2, pairs=4, seq_len=64, warmup=1)), race_steps=2,
                 seq_len=1024, chunk_size=256, page_size=64, steps=2, warmup=1, pairs=8, save_every=1,
                 stage_eval_every=2, stage_gate=0.0, eval_every=2, eval_batches=1, corpus_bytes=2 * 2**20, edges=(0, 256, 1024),
                 queries=4, eval_pairs=8, loss_windows=1, device="cpu", backend="torch", budget_divisor=16)


@dataclass
class Arm:
    name: str
    what: str
    budget: int = 0  # top-k pages (0: dense)
    dense_layers: str = ""
    seed: int = 0  # added to the study's seed (data order): a replicate
    extra: bool = False  # a replicate: run when named in --arms (or --arms all)
    design: Design | None = None  # an entrant of the race for base-128
    start: str = ""  # the arm it starts from, where not the curriculum's order (the 4K -> 64K extension)
    shape: str = ""  # a stage whose sequences, steps, stop and gate this arm has, outside the curriculum
    rope: str = ""  # a RoPE base set at its start: 'short' (Study.short_rope_theta), 'long' (rope_theta)

    @property
    def attention(self) -> str:
        return label(self.budget, self.dense_layers)

    @property
    def is_stage(self) -> bool:
        return self.name in STAGES or bool(self.shape)

    @property
    def stage_name(self) -> str:
        """The stage whose settings (Study.stages) a stage-like arm trains with."""
        return self.shape or self.name

    @property
    def extends(self) -> str:
        """The arm whose final model this one starts from ('' : from scratch)."""
        if self.design is not None:
            return ""
        if self.start:
            return self.start
        if self.is_stage:
            i = STAGES.index(self.name)
            return STAGES[i - 1] if i else ""
        return STAGES[-1]


def label(budget: int, dense_layers: str = "") -> str:
    """How rows name an attention: dense, top-64, top-16 (layers 0,1 dense)."""
    if not budget:
        return "dense"
    return f"top-{budget}" + (f" (layers {dense_layers} dense)" if dense_layers else "")


ARMS = [
    Arm("base-128", "dense, 128-token sequences, from scratch: where recall is discovered"),
    Arm("base-1k", "dense, 1K-token sequences"),
    Arm("base-4k", "dense, 4K-token sequences"),
    Arm("base-16k", "dense, 16K-token sequences (the 64K arms' start)"),
    Arm("dense-64k", "dense (positive control)"),
    Arm("topk64-64k", "top-k 64 pages", budget=64),
    Arm("topk16-64k", "top-k 16 pages", budget=16),
    Arm("topk16-d01-64k", "top-k 16 pages, layers 0 and 1 dense", budget=16, dense_layers="0,1"),
    Arm("neg-64k", "top-k 1 page, the sink only (negative control)", budget=1),
    Arm("dense-64k-s1", "dense, another data order", seed=1, extra=True),
    Arm("topk64-64k-s1", "top-k 64 pages, another data order", budget=64, seed=1, extra=True),
    # a user's flow: a 4K model with a short RoPE base (short-4k: base-1k moved to base 1e4 and trained
    # at 4K as base-4k is) extended to 64K by raising the base (--rope-theta) and training there,
    # densely or with top-k
    Arm("short-4k", "dense, 4K-token sequences, RoPE base 1e4 (the extension arms' start)", start="base-1k",
        shape="base-4k", rope="short", extra=True),
    Arm("ext-dense-64k", "dense, from short-4k with RoPE base 5e6 (4K extended to 64K)", start="short-4k",
        rope="long", extra=True),
    Arm("ext-topk64-64k", "top-k 64 pages, from short-4k with RoPE base 5e6 (4K extended to 64K)", budget=64,
        start="short-4k", rope="long", extra=True),
]
BY_NAME = {a.name: a for a in ARMS}
RACE_PREFIX = "race-"


def find_arm(name: str, study: Study) -> Arm:
    """An arm of ARMS, or an entrant of the study's race (race-<design>)."""
    if name.startswith(RACE_PREFIX):
        for d in study.race:
            if RACE_PREFIX + d.name == name:
                return Arm(name, f"race entrant: {d.model}, {d.seq_len} x {d.batch}, lr {d.lr}", design=d)
    if name not in BY_NAME:
        raise KeyError(name)
    return BY_NAME[name]


def entrants(study: Study) -> list[str]:
    return [RACE_PREFIX + d.name for d in study.race]


OTHER_BUDGET = 64  # a dense arm is also read with top-k 64, a top-k one densely


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
    if arm.design is not None:
        d = arm.design
        shape = dict(seq_len=d.seq_len, batch=d.batch, steps=study.race_steps, lr=d.lr, warmup_steps=d.warmup,
                     lr_schedule="constant", recall_pairs=d.pairs, eval_every=study.stage_eval_every)
    elif arm.is_stage:
        st = study.stage(arm.stage_name)
        shape = dict(seq_len=st.seq_len, batch=st.batch, steps=st.steps, lr=st.lr, warmup_steps=st.warmup,
                     lr_schedule="constant", recall_pairs=st.pairs, eval_every=study.stage_eval_every)
    else:
        shape = dict(seq_len=study.seq_len, batch=1, steps=study.steps, lr=study.lr, warmup_steps=study.warmup,
                     recall_pairs=study.pairs, eval_every=study.eval_every)
    return TrainConfig(
        model=str(work / "arms" / arm.extends / "final") if arm.extends else (
            arm.design.model if arm.design is not None else study.model),
        data=str(data / "train.npy"), eval_data=str(data / "heldout.npy"), **shape,
        weight_decay=study.weight_decay, chunk_size=min(study.chunk_size, shape["seq_len"]),
        page_size=study.page_size, sparse_budget=study.pages(arm.budget), sparse_dense_layers=arm.dense_layers,
        sparse_sink_pages=1, rope_theta=rope_theta(arm, study),
        recall_keys=study.recall_keys, recall_values=study.recall_values, output_dir=str(out),
        save_every=study.save_every, eval_batches=study.eval_batches, resume="auto", seed=study.seed + arm.seed,
        device=study.device, backend=study.backend)


def rope_theta(arm: Arm, study: Study) -> float | None:
    """The RoPE base an arm sets at its start: the study's from scratch, the arm's own (a context
    extension), else None (its base model's)."""
    if arm.rope:
        return {"short": study.short_rope_theta, "long": study.rope_theta}[arm.rope]
    return None if arm.extends else study.rope_theta


def mean_recall(recall: dict) -> float:
    """A held-out evaluation's recall ({bucket: accuracy}) as one number: the mean over its buckets."""
    return sum(recall.values()) / len(recall)


class StopAt:
    """oomb.train's callback that ends a stage or race entrant early: once its held-out recall (the
    mean over the distance buckets) reaches `target`, or `seconds` after it started."""

    def __init__(self, target: float, seconds: float) -> None:
        self.target, self.seconds, self.start = target, seconds, time.monotonic()
        self.why = ""

    def on_evaluate(self, step: int, results: dict) -> bool:
        recall = results.get("eval_recall")
        if recall and mean_recall(recall) >= self.target:
            self.why = f"held-out recall {mean_recall(recall):.3f} >= {self.target}"
        return bool(self.why)

    def on_step_end(self, step: int, metrics: dict) -> bool:
        if not self.why and time.monotonic() - self.start >= self.seconds:
            self.why = f"time box of {self.seconds:.0f} s"
        return bool(self.why)


def time_box(arm: Arm, study: Study) -> float:
    if arm.design is not None:
        return study.race_seconds
    return study.stage(arm.stage_name).seconds if arm.is_stage else float("inf")


def evaluations(arm: Arm) -> list[tuple[str, int, str]]:
    """(task, top-k budget or 0, dense layers) of every evaluation of an arm's final model:
    kv-recall with the attention the arm trained with and with the other (top-k read densely,
    dense read with top-k 64), and the held-out loss with its own; none for a race entrant (the
    winner is read as base-128)."""
    if arm.design is not None:
        return []
    other = 0 if arm.budget else OTHER_BUDGET
    return [("kv-recall", arm.budget, arm.dense_layers), ("kv-recall", other, ""),
            ("loss", arm.budget, arm.dense_layers)]


def evaluation_key(arm: Arm, task: str, budget: int, dense: str) -> tuple[str, str]:
    """How an evaluation's row is found again: (task, attention label)."""
    return task, label(budget, dense)


def evaluated(name: str, rows: list[dict]) -> set[tuple[str, str]]:
    """The evaluation keys an arm's rows already hold."""
    return {(r.get("task"), r.get("attention")) for r in rows
            if r.get("study") == STUDY and r.get("arm") == name and r.get("kind") == "eval"}


def evaluate(study: Study, model, held, task: str, budget: int, dense: str) -> dict:
    """One evaluation of an arm's final model (loaded once per arm) on the held-out tokens, at
    the study's sequence length."""
    from oomb import ChunkRecurrentEngine, TopKPages
    from oomb.eval.kv_recall import kv_recall
    from oomb.eval.loss import mean_loss
    from oomb.data.recall import RecallTask, evaluation_sequences
    from oomb.data.tokens import windows
    from oomb.units import parse_layers

    sparse = TopKPages(budget=study.pages(budget), dense_layers=parse_layers(dense),
                       sink_pages=1) if budget else None
    engine = ChunkRecurrentEngine(model, chunk_size=study.chunk_size, page_size=study.page_size, sparse=sparse,
                                  kv_grad_dtype=None, backend=study.backend, offload="auto")
    t0 = time.perf_counter()
    if task == "kv-recall":
        recall = RecallTask(study.recall_keys, study.recall_values)
        edges = list(study.edges)
        sequences = evaluation_sequences(held, recall, model.config.vocab_size, study.seq_len, study.chunk_size,
                                         edges, study.queries, study.eval_pairs, seed=study.seed + 1)
        result = kv_recall(engine, sequences, recall, edges)
    else:
        result = mean_loss(engine, windows(held, study.seq_len, 1, study.loss_windows))
    return {**result, "eval_s": round(time.perf_counter() - t0, 1), "attention": label(budget, dense)}


def hand_off(final: Path, folder: Path, shard: str = "15MB") -> None:
    """A final model as bf16 safetensors shards of at most 15 MB and its config: what one device
    call may bring back (files <= 16 MiB), so that a study can go on on another machine."""
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").exists():
        return
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=shard)
    tmp.rename(folder)


def take_over(handoff: Path, work: Path) -> list[str]:
    """The arms whose final model an earlier machine handed off (hand_off) and this one lacks,
    copied into their places under work/arms."""
    taken = []
    for src in sorted(handoff.glob("*/config.json")) if handoff.is_dir() else []:
        final = work / "arms" / src.parent.name / "final"
        if src.parent.name in BY_NAME and not (final / "config.json").exists():
            shutil.copytree(src.parent, final, dirs_exist_ok=True)
            taken.append(src.parent.name)
    return taken


def run_arm(name: str, study: Study, work: Path, rows_file: Path, info: dict, handoff: Path | None = None) -> None:
    """Train the arm (or resume it) and evaluate its final model; rows appended to rows_file.
    handoff: the final model is also written there (hand_off)."""
    from oomb.train.trainer import train

    arm = find_arm(name, study)
    data = corpus(study, work)
    out = work / "arms" / name
    done = evaluated(name, read_rows(rows_file))
    tag = {"study": STUDY, "arm": name}
    if not (out / "final" / "config.json").exists():
        cfg = train_config(arm, study, work, data)
        stop = StopAt(study.stage_target, time_box(arm, study)) if arm.is_stage or arm.design is not None else None
        t0 = time.perf_counter()
        train(cfg, callbacks=[stop] if stop else ())
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        append(rows_file, [{**tag, "kind": "train", **r, **info} for r in steps]
               + [{**tag, "kind": "trained", "train_s": round(time.perf_counter() - t0, 1),
                   "config": dataclasses.asdict(cfg), "stopped": stop.why if stop else "", **info}])
    if handoff is not None and arm.design is None:
        hand_off(out / "final", handoff / name)
    todo = [e for e in evaluations(arm) if evaluation_key(arm, *e) not in done]
    if not todo:
        return
    import torch

    from oomb.presets import load_model
    from oomb.data.tokens import open_tokens
    from oomb.train.trainer import resolve_device

    device = resolve_device(study.device)
    model = load_model(str(out / "final"), device=device,
                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    held = open_tokens(data / "heldout.npy", model.config.vocab_size)
    for task, budget, dense in todo:
        r = evaluate(study, model, held, task, budget, dense)
        append(rows_file, [{**tag, "kind": "eval", "trained_with": arm.attention, **r, **info}])
        print(f"{name}: {task} read with {r['attention']}: " + (
            ", ".join(f"{b['bucket']} {b['accuracy']:.3f}" for b in r["buckets"]) if task == "kv-recall"
            else f"loss {r['loss']:.4f}"), flush=True)


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


def complete(name: str, rows: list[dict], study: Study) -> bool:
    arm = find_arm(name, study)
    if arm.design is not None:
        return any(r.get("arm") == name and r.get("kind") == "trained" for r in rows)
    return {evaluation_key(arm, *e) for e in evaluations(arm)} <= evaluated(name, rows)


def last_recall(path: Path) -> tuple[float, int] | None:
    """The last held-out recall in a run's metrics.jsonl (the mean over its distance buckets) and
    its step; None: no evaluation row."""
    rows = [r for r in read_rows(path) if "eval_recall" in r] if path.exists() else []
    return (mean_recall(rows[-1]["eval_recall"]), rows[-1]["step"]) if rows else None


def pick_winner(study: Study, work: Path, results: Path, info: dict) -> str | None:
    """base-128 from the race: the entrant with the best last held-out recall (the first on a tie)
    copied to arms/base-128 (its final model and metrics), and a 'trained' row for base-128 naming
    every entrant's recall. None: no entrant finished."""
    board = []
    for name in entrants(study):
        got = last_recall(work / "arms" / name / "metrics.jsonl")
        if got is not None and (work / "arms" / name / "final" / "config.json").exists():
            board.append((name, *got))
    if not board:
        return None
    winner = max(board, key=lambda b: b[1])[0]  # max keeps the first of equals
    base = work / "arms" / "base-128"
    tmp = base.with_name(base.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(work / "arms" / winner / "metrics.jsonl", tmp / "metrics.jsonl")
    shutil.copytree(work / "arms" / winner / "final", tmp / "final")
    shutil.rmtree(base, ignore_errors=True)
    tmp.rename(base)
    rows = read_rows(results)
    trained = next(r for r in rows if r.get("arm") == winner and r.get("kind") == "trained")
    append(results, [{"study": STUDY, "arm": "base-128", "kind": "trained", "winner": winner,
                      "race": [{"entrant": n, "recall": round(rc, 4), "step": st} for n, rc, st in board],
                      "train_s": trained["train_s"], "config": trained["config"], **info}])
    print("race for base-128: " + ", ".join(f"{n} {rc:.3f} at step {st}" for n, rc, st in board)
          + f"; winner {winner}", flush=True)
    return winner


# -- the study: arms in parallel, dependencies first -----------------------------------------

def run_study(study: Study, names: list[str], work: Path, results: Path, jobs: int, deadline: float,
              handoff: Path | None = None) -> None:
    from common import run_info

    info = run_info()
    info["setting"] = "smoke" if study.model == "tiny-kv" else "full"
    work.mkdir(parents=True, exist_ok=True)
    if handoff is not None:
        taken = take_over(handoff, work)
        if taken:
            print(f"quality study: final models of {', '.join(taken)} taken from {handoff}", flush=True)
    data = corpus(study, work)  # once, before the arms start
    todo = [n for n in names if not complete(n, read_rows(results), study)]
    print(f"quality study: {len(names) - len(todo)} of {len(names)} arms already in {results}; running "
          f"{', '.join(todo) or 'none'}", flush=True)
    race = "base-128" in todo and study.race and not (work / "arms" / "base-128" / "final" / "config.json").exists()
    if race:  # base-128 is the race's winner: its entrants first
        todo = [n for n in entrants(study) if not complete(n, read_rows(results), study)] + todo
    for n in todo:  # each arm's configuration is checked here, before any arm spends time
        try:
            train_config(find_arm(n, study), study, work, data)
        except ValueError as e:
            raise SystemExit(f"quality.py: arm {n}'s training configuration is refused: {e}") from None
    start = time.perf_counter()
    if jobs == 0:  # in this process, one after another (the CPU smoke test)
        for n in _ordered(todo, study):
            if n == "base-128" and race and pick_winner(study, work, results, info) is None:
                print("quality study: no race entrant finished; base-128 not made", flush=True)
                return
            run_arm(n, study, work, results, info, handoff)
        return
    running: dict[str, subprocess.Popen] = {}
    waiting = _ordered(todo, study)
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
        if race and "base-128" in waiting and not any(n.startswith(RACE_PREFIX) for n in [*waiting, *running]):
            race = False  # every entrant has ended: the best becomes base-128
            if pick_winner(study, work, results, info) is None:
                waiting.remove("base-128")
                failed.append("base-128")
                print(f"{elapsed()} base-128: no race entrant finished", flush=True)
        for n in [n for n in waiting if find_arm(n, study).extends in failed]:  # its base failed: it cannot start
            waiting.remove(n)
            failed.append(n)
        for n in [n for n in waiting if _ready(n, work, study)]:  # built on a stage below the gate: not started
            base = find_arm(n, study).extends
            recall = stage_recall(base, work) if base and BY_NAME[base].is_stage else None
            if recall is not None and recall < study.stage_gate:
                waiting.remove(n)
                failed.append(n)
                print(f"{elapsed()} {n}: not started: {base}'s held-out recall {recall:.3f} is below the stage "
                      f"gate {study.stage_gate} (Study.stage_gate)", flush=True)
        late = time.perf_counter() - start >= deadline
        for n in [n for n in waiting if _ready(n, work, study) and not (n == "base-128" and race)]:
            if len(running) >= jobs or late:
                break
            waiting.remove(n)
            log = open(work / f"{n}.log", "a")
            cmd = [sys.executable, __file__, "--arm", n, "--work", str(work), "--results", str(results)]
            cmd += ["--handoff", str(handoff)] if handoff is not None else []
            running[n] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"{elapsed()} {n}: started", flush=True)
        if late and not running:
            break
        time.sleep(2)
    if failed or waiting:
        print(f"quality study: not finished: failed {failed}, not started {waiting} (see {work}/<arm>.log)",
              flush=True)


def _ordered(names: list[str], study: Study) -> list[str]:
    """Race entrants first, then arms from scratch, then the rest, each in ARMS order."""
    def key(n: str):
        arm = find_arm(n, study)
        return (arm.design is None, bool(arm.extends), ARMS.index(arm) if arm.design is None else 0)
    return sorted(names, key=key)


def stage_recall(name: str, work: Path) -> float | None:
    """A trained stage's last held-out recall, the mean over its distance buckets (None: no
    evaluation row, e.g. a stage taken over from a hand-off)."""
    got = last_recall(work / "arms" / name / "metrics.jsonl")
    return got[0] if got else None


def _ready(name: str, work: Path, study: Study) -> bool:
    base = find_arm(name, study).extends
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
    parser.add_argument("--steps", type=int, default=0, help="override the 64K arms' steps")
    parser.add_argument("--handoff", default="", help="a folder: each arm trained writes its final model there "
                                                      "(bf16 shards <= 15 MB), and arms whose final model is there "
                                                      "are taken from it (a study chained across machines)")
    parser.add_argument("--report", action="store_true", help="write docs/quality.md and its plots from --results")
    parser.add_argument("--doc", default=str(DOC), help="the page --report writes (its plots beside it)")
    args = parser.parse_args()
    study = smoke() if args.smoke else Study()
    if args.steps:
        study.steps = args.steps
    work, results = Path(args.work), Path(args.results)
    handoff = Path(args.handoff) if args.handoff else None
    if args.report:
        from quality_report import write_report
        write_report(read_rows(results), Path(args.doc))
        return
    if args.arm:  # a child of run_study: the parent's settings and run information
        given = json.loads(os.environ["OOMB_QUALITY"])
        run_arm(args.arm, Study(**given["study"]), work, results, given["info"], handoff)
        return
    names = [n.strip() for n in args.arms.split(",") if n.strip()] or [a.name for a in ARMS if not a.extra]
    if names == ["all"]:
        names = [a.name for a in ARMS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        sys.exit(f"quality.py: unknown arm {unknown[0]!r}; arms: {', '.join(BY_NAME)}")
    for n in names:
        base = BY_NAME[n].extends
        handed = handoff is not None and (handoff / base / "config.json").exists()
        if base and base not in names and not handed and not (work / "arms" / base / "final" / "config.json").exists():
            sys.exit(f"quality.py: arm {n} starts from {base}'s final model: add {base} to --arms")
    run_study(study, names, work, results, 0 if args.smoke else args.jobs, args.deadline, handoff)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
