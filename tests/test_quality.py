"""bench/quality.py --smoke: every arm of the study and every evaluation, tiny, on CPU; then --report."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quality_study_smoke_and_report(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    script = os.path.join(ROOT, "bench", "quality.py")
    results = tmp_path / "quality.jsonl"
    run = [sys.executable, script, "--smoke", "--work", str(tmp_path / "work"), "--results", str(results)]
    subprocess.run(run, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    arms = {"dense-64k", "topk64-64k", "topk16-64k", "base-8k", "ext-dense", "ext-topk64", "ext-tail-dense",
            "ext-tail-topk64", "ext-tail-topk64-d2"}
    assert {r["arm"] for r in rows if r["kind"] == "trained"} == arms
    evals = [r for r in rows if r["kind"] == "eval"]
    assert {r["task"] for r in evals} == {"position-loss", "retrieval", "selection-recall"}
    # each arm read with its own attention and with the other
    assert {(r["arm"], r["attention"]) for r in evals if r["task"] == "position-loss"} >= {
        ("dense-64k", "dense"), ("dense-64k", "top-64"), ("topk64-64k", "top-64"), ("topk64-64k", "dense")}
    tail = next(r for r in rows if r["kind"] == "trained" and r["arm"] == "ext-tail-topk64-d2")["config"]
    assert tail["loss_last"] > 0 and tail["sparse_dense_layers"] == "-2,-1" and tail["rope_theta"] > 10_000
    # resumable: a second run finds every arm done and computes nothing
    again = subprocess.run(run, check=True, env=env, capture_output=True, text=True)
    assert "9 of 9 arms already in" in again.stdout and len(results.read_text().splitlines()) == len(rows)
    doc = tmp_path / "docs" / "quality.md"
    doc.parent.mkdir()
    doc.write_text("# Quality\n\nhand-written findings\n")
    subprocess.run([sys.executable, script, "--report", "--results", str(results), "--doc", str(doc)], check=True,
                   env=env, capture_output=True)
    page = doc.read_text()
    assert page.startswith("# Quality\n\nhand-written findings\n")  # kept
    for heading in ("### Arms", "### Held-out loss", "### Retrieval by length", "### Top-k selection recall"):
        assert heading in page
    for png in ("quality_training.png", "quality_position_loss.png", "quality_retrieval.png", "quality_recall.png"):
        assert (doc.parent / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in page
