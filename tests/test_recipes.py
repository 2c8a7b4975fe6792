"""The recipes in recipes/ (README's cases as --config files): each runs a step on the tiny model
with only the size flags given beside it, and the run takes every other setting from the recipe."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from oomb.cli import build_parser, main
from oomb.flags import read_config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
#: the flags given beside every recipe: a tiny model and a sequence the CPU trains in seconds
SIZE = {"model": "tiny", "data": "copy", "seq_len": 256, "chunk_size": 128, "page_size": 32, "steps": 1,
        "device": "cpu", "backend": "torch"}


def test_the_readme_cases_have_recipes():
    assert {p.stem for p in RECIPES} == {"lora-64k", "topk-1m", "min-memory-1m", "chat-128k", "extend-32k-to-128k"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_runs_a_step_with_its_settings(recipe, tmp_path):
    _, commands = build_parser()
    settings = read_config(str(recipe), commands["train"])  # each value as its flag reads it
    assert settings and not set(settings) & {"model", "data"}  # the user names the model and the data
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZE.items()]
    main(["train", "--config", str(recipe), *flags, "--output-dir", str(tmp_path)])
    used = yaml.safe_load((tmp_path / "config.yaml").read_text())
    given = {k: v for k, v in settings.items() if k not in SIZE and k != "output_dir"}
    assert {k: used[k] for k in given} == given
    assert used["seq_len"] == 256 and used["output_dir"] == str(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and "eval_loss" not in r] == [1]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
