"""bench/quality.py --smoke: every arm of the recall study and every evaluation, tiny, on CPU; then --report."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quality_study_smoke_and_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    script = os.path.join(ROOT, "bench", "quality.py")
    results = tmp_path / "quality.jsonl"
    run = [sys.executable, script, "--smoke", "--work", str(tmp_path / "work"), "--results", str(results)]
    subprocess.run(run, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    arms = {"base-128", "base-1k", "base-4k", "base-16k", "dense-64k", "topk64-64k", "topk16-64k", "topk16-d01-64k", "neg-64k"}
    assert {r["arm"] for r in rows if r["kind"] == "trained"} == arms | {"race-a", "race-b"}
    # base-128 is the race's winner: the entrant with the best held-out recall, its model copied
    race = next(r for r in rows if r["kind"] == "trained" and r["arm"] == "base-128")
    board = {e["entrant"]: e["recall"] for e in race["race"]}
    assert set(board) == {"race-a", "race-b"} and board[race["winner"]] == max(board.values())
    assert race["config"]["lr"] == {"race-a": 1e-3, "race-b": 3e-3}[race["winner"]]
    assert not any(r["kind"] == "eval" and r["arm"].startswith("race-") for r in rows)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert {r["task"] for r in evals} == {"kv-recall", "loss"}
    # each arm read with its own attention and with the other
    assert {(r["arm"], r["attention"]) for r in evals if r["task"] == "kv-recall"} >= {
        ("dense-64k", "dense"), ("dense-64k", "top-64"), ("topk64-64k", "top-64"), ("topk64-64k", "dense"),
        ("neg-64k", "top-1"), ("topk16-d01-64k", "top-16 (layers 0,1 dense)")}
    recall = next(r for r in evals if r["arm"] == "neg-64k" and r["attention"] == "top-1")
    assert [b["bucket"] for b in recall["buckets"]] == ["same chunk", "0-256", "256-1K"]
    assert all(b["queries"] == 4 for b in recall["buckets"]) and recall["hit_rate"]
    config = {r["arm"]: r["config"] for r in rows if r["kind"] == "trained"}
    assert config["base-128"]["rope_theta"] > 10_000 and config["base-128"]["lr_schedule"] == "constant"
    assert [config[a]["seq_len"] for a in ("base-128", "base-1k", "base-4k", "base-16k", "dense-64k")] == [
        64, 128, 256, 512, 1024]
    assert config["base-1k"]["model"].endswith("base-128/final") and config["dense-64k"]["model"].endswith(
        "base-16k/final")
    assert any("eval_recall" in r for r in rows if r["kind"] == "train")  # the learning curve
    # resumable: a second run finds every arm done and computes nothing
    again = subprocess.run(run, check=True, env=env, capture_output=True, text=True)
    assert "9 of 9 arms already in" in again.stdout and len(results.read_text().splitlines()) == len(rows)
    pilot = {"study": "recall-pilot", "variant": "F", "step": 100, "eval_loss": 1.0, "eval_recall": {"same chunk": 0.1},
             "config": {"start": "from scratch", "seq_len": 128, "batch": 128, "recall_pairs": 12, "recall_keys": 256,
                        "recall_values": 256, "lr": 1e-3}, "commit": "abc1234", "date": "2026-12-04"}
    with results.open("a") as f:
        f.write(json.dumps(pilot) + "\n")
        f.write(json.dumps({**pilot, "variant": "G", "config": {**pilot["config"], "start": "from F's final"}}) + "\n")
    doc = tmp_path / "docs" / "quality.md"
    doc.parent.mkdir()
    doc.write_text("# Quality\n\nhand-written findings\n")
    subprocess.run([sys.executable, script, "--report", "--results", str(results), "--doc", str(doc)], check=True,
                   env=env, capture_output=True)
    page = doc.read_text()
    assert page.startswith("# Quality\n\nhand-written findings\n")  # kept
    for heading in ("### The pilot", "### Arms of the study", "### Recall by needle-to-query distance",
                    "### Needle-page hit rate", "### Held-out loss"):
        assert heading in page
    assert "| neg-64k | top-1 |" in page
    fresh = tmp_path / "not-yet" / "quality.md"  # a page in a directory that does not exist yet
    subprocess.run([sys.executable, script, "--report", "--results", str(results), "--doc", str(fresh)], check=True,
                   env=env, capture_output=True)
    assert "### Arms of the study" in fresh.read_text() and (fresh.parent / "quality_pilot.png").exists()
    assert (doc.parent / "quality_pilot.png").read_bytes()[:4] == b"\x89PNG" and "](quality_pilot.png)" in page


def test_hand_off_and_take_over(tmp_path):
    """A final model handed off in shards no larger than asked, and taken over by another work
    folder, where it loads with the same weights."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import quality
    import torch

    from oomb.presets import load_model

    model = load_model("tiny-kv")
    final = tmp_path / "a" / "arms" / "base-128" / "final"
    model.save_pretrained(final)
    handoff = tmp_path / "handoff"
    quality.hand_off(final, handoff / "base-128", shard="300KB")
    shards = sorted((handoff / "base-128").glob("*.safetensors"))
    assert len(shards) > 1 and all(f.stat().st_size <= 400_000 for f in shards)
    assert quality.take_over(handoff, tmp_path / "b") == ["base-128"]
    assert quality.take_over(handoff, tmp_path / "b") == []  # already there
    again = load_model(str(tmp_path / "b" / "arms" / "base-128" / "final"))
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p.to(torch.bfloat16).float(), q.float()), name


def test_a_stage_below_the_gate_starts_nothing_built_on_it(tmp_path, capsys, monkeypatch):
    """A trained stage whose last held-out recall is below Study.stage_gate: the stage built on it is
    not started (no process), and is reported with the recall and the gate."""
    import dataclasses
    import types

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import quality

    study = dataclasses.replace(quality.smoke(), stage_gate=0.9)
    base = tmp_path / "work" / "arms" / "base-128"
    (base / "final").mkdir(parents=True)
    (base / "final" / "config.json").write_text("{}")
    rows = [{"step": 2, "eval_loss": 3.0, "eval_recall": {"same chunk": 0.5, "0-1K": 0.3}},
            {"step": 4, "eval_loss": 2.9, "eval_recall": {"same chunk": 0.95, "0-1K": 0.75}}]
    (base / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert quality.stage_recall("base-128", tmp_path / "work") == 0.85  # the last row's mean
    def popen(*args, **kwargs):
        raise AssertionError(f"started {args}")
    monkeypatch.setattr(quality, "subprocess", types.SimpleNamespace(Popen=popen))
    quality.run_study(study, ["base-1k"], tmp_path / "work", tmp_path / "rows.jsonl", jobs=1, deadline=60)
    out = capsys.readouterr().out
    assert "base-1k: not started: base-128's held-out recall 0.850 is below the stage gate 0.9" in out
    assert "not finished: failed ['base-1k']" in out


def test_the_race_makes_base_128_of_the_entrant_with_the_best_last_recall(tmp_path):
    """pick_winner: the entrant whose last held-out recall (the mean over its buckets) is best, not
    its best ever, becomes base-128 (its final model and metrics copied), with a row naming them all."""
    import dataclasses

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import quality

    study = dataclasses.replace(quality.smoke(), race=(quality.Design("a", "tiny-kv", 1e-3),
                                                       quality.Design("b", "tiny-kv", 3e-3)))
    work, results = tmp_path / "work", tmp_path / "rows.jsonl"
    curves = {"race-a": [0.9, 0.4], "race-b": [0.2, 0.7]}  # a's best is higher, b's last is
    for name, recalls in curves.items():
        arm = work / "arms" / name
        (arm / "final").mkdir(parents=True)
        (arm / "final" / "config.json").write_text(json.dumps({"entrant": name}))
        rows = [{"step": 10 * (i + 1), "eval_recall": {"same chunk": r, "0-1K": r / 2}} for i, r in enumerate(recalls)]
        (arm / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        quality.append(results, [{"study": "recall", "arm": name, "kind": "trained", "train_s": 1.0,
                                  "config": {"lr": {"race-a": 1e-3, "race-b": 3e-3}[name]}}])
    assert quality.pick_winner(study, work, results, {}) == "race-b"
    base = work / "arms" / "base-128"
    assert json.loads((base / "final" / "config.json").read_text()) == {"entrant": "race-b"}
    assert quality.stage_recall("base-128", work) == (0.7 + 0.35) / 2
    row = quality.read_rows(results)[-1]
    assert row["arm"] == "base-128" and row["winner"] == "race-b" and row["config"]["lr"] == 3e-3
    assert [(e["entrant"], e["recall"], e["step"]) for e in row["race"]] == [("race-a", 0.3, 20), ("race-b", 0.525, 20)]


def test_an_arm_whose_configuration_is_refused_stops_the_study_before_anything_starts(tmp_path, monkeypatch):
    """Every arm's TrainConfig is built before the first one starts: a race entrant with more recall
    pairs than its sequences hold stops the study with the arm and the reason, no process started."""
    import dataclasses
    import types

    import pytest

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import quality

    study = dataclasses.replace(quality.smoke(), race=(quality.Design("a", "tiny-kv", 1e-3, pairs=24, seq_len=64),))
    def popen(*args, **kwargs):
        raise AssertionError(f"started {args}")
    monkeypatch.setattr(quality, "subprocess", types.SimpleNamespace(Popen=popen))
    with pytest.raises(SystemExit, match=r"arm race-a's training configuration is refused: recall_pairs=24"):
        quality.run_study(study, ["base-128"], tmp_path / "work", tmp_path / "rows.jsonl", jobs=1, deadline=60)


def test_every_arm_of_the_full_study_has_a_configuration(tmp_path):
    """Each arm of `--arms all` at the full settings (not the smoke test's) builds its TrainConfig;
    the 64K arms start from base-16k's final model, the 4K -> 64K extension arms from short-4k's."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import quality

    study = quality.Study()
    cfgs = {arm.name: quality.train_config(arm, study, tmp_path, tmp_path / "corpus") for arm in quality.ARMS}
    starts = {n: Path(c.model).parent.name if c.model.endswith("final") else c.model for n, c in cfgs.items()}
    for arm in quality.ARMS:
        if not arm.is_stage:
            assert cfgs[arm.name].seq_len == 65536 and cfgs[arm.name].sparse_budget == arm.budget
    assert starts["base-128"] == "byte-kv-30m" and starts["base-16k"] == "base-4k"
    assert starts["dense-64k"] == starts["topk64-64k-s1"] == "base-16k"
    assert starts["short-4k"] == "base-1k" and starts["ext-dense-64k"] == starts["ext-topk64-64k"] == "short-4k"
    # the extension: a 4K model with a short RoPE base, raised for 64K; the curriculum keeps its base
    thetas = {n: c.rope_theta for n, c in cfgs.items()}
    assert thetas["short-4k"] == study.short_rope_theta and thetas["ext-topk64-64k"] == study.rope_theta
    assert thetas["base-128"] == study.rope_theta and thetas["base-1k"] is None and thetas["dense-64k"] is None
    short, base4k = cfgs["short-4k"], cfgs["base-4k"]
    assert (short.seq_len, short.batch, short.steps) == (base4k.seq_len, base4k.batch, base4k.steps)
    assert quality.time_box(quality.BY_NAME["short-4k"], study) == study.stage("base-4k").seconds
