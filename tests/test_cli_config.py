"""One vocabulary of settings: every flag of train / plan / eval comes from TrainConfig's declarations
(help, choices, one default), a --config file sets them (the command line wins), and a run's
config.yaml holds what it resolved, so a --config of it runs the same steps."""
import argparse
import dataclasses
import json

import pytest
import yaml

from oomb.cli import EVAL_OVERRIDES, PLAN_OVERRIDES, build_parser, main, parse_args
from oomb.eval import TASKS
from oomb.train.config import TrainConfig

FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
TINY = ["--seq-len", "64", "--page-size", "16", "--steps", "2", "--backend", "torch", "--device", "cpu"]


def flags(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["train", "plan", "eval"])
def test_every_flag_has_its_help_choices_and_one_default(command):
    parser = build_parser()[1][command]
    text = parser.format_help()
    tasks = {k: v for t in TASKS.values() for k, v in t.settings.items()}  # a task's settings, as it declares them
    overrides = {"plan": PLAN_OVERRIDES, "eval": {**EVAL_OVERRIDES, **tasks}}.get(command, {})
    for action in flags(parser):
        assert action.help and len(action.help) > 10, action.option_strings
        field = FIELDS.get(action.dest)
        if field is None:
            continue  # the command's own flag (plan's --gpu-memory, eval's --task ...)
        if "help" not in overrides.get(field.name, {}):
            assert action.help == field.metadata["help"].replace("%", "%%")
        if "choices" in field.metadata:
            choices = overrides.get(field.name, {}).get("choices", field.metadata["choices"])
            assert tuple(action.choices) == tuple(choices) and "{" + ",".join(choices) + "}" in text
        # one default per setting; a command's own is declared in its OVERRIDES (with why)
        assert action.default == overrides.get(field.name, {}).get("default", field.default), field.name
    if command == "train":
        assert {a.dest for a in flags(parser)} == {*FIELDS, "config"}


def test_help_shows_descriptions_and_choices(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--backend {torch,triton,auto} attention kernels: triton (CUDA)" in out
    assert "after the warm-up: cosine (decay to 10 % of the peak by the last step)" in out
    assert "--seq-len SEQ_LEN tokens in each sequence, e.g. 4096, 64K or 1M (default: 1024)" in out


def write(path, text):
    path.write_text(text)
    return str(path)


def test_config_file_under_the_command_line(tmp_path):
    path = write(tmp_path / "run.yaml", "steps: 2\nlr: 1e-2\nseq_len: 64K\ncompile: false\nrope_theta: null\n"
                                        "kv-grad-dtype: bfloat16\n")
    args = parse_args(["train", "--config", path, "--lr", "0.05", "--compile"])
    assert (args.steps, args.lr, args.seq_len, args.compile, args.kv_grad_dtype) == (2, 0.05, 65536, True, "bfloat16")
    assert args.batch == 1 and args.chunk_size == "auto"  # neither given: the declared defaults
    js = write(tmp_path / "run.json", json.dumps({"steps": 3, "offload": "all", "checkpoint_layers": True}))
    args = parse_args(["train", "--config", js, "--no-checkpoint-layers"])
    assert (args.steps, args.offload, args.checkpoint_layers) == (3, "all", False)
    # plan reads a run's file: the settings plan takes, the others skipped; one length becomes the list
    args = parse_args(["plan", "--config", path])
    assert args.seq_len == [65536] and args.kv_grad_dtype == "bfloat16" and args.model == "qwen2.5-7b"


@pytest.mark.parametrize("command", ["train", "plan", "eval"])
def test_negative_layer_lists_are_values(command):
    """The documented `--sparse-dense-layers -2,-1` (argparse takes '-2,-1' for an option unless
    it is told otherwise); a single negative value and `--flag=value` as before."""
    args = parse_args([command, "--sparse-dense-layers", "-2,-1", "--sparse-budget", "4"])
    assert (args.sparse_dense_layers, args.sparse_budget) == ("-2,-1", 4)
    assert parse_args([command, "--sparse-dense-layers", "-1"]).sparse_dense_layers == "-1"
    assert parse_args([command, "--sparse-dense-layers=0,-1"]).sparse_dense_layers == "0,-1"


@pytest.mark.parametrize("text,message", [
    ("lrr: 0.1\n", "'lrr' is not a setting of oomb train; did you mean 'lr'?"),
    ("steps: two\n", "steps: 'two': 'two' is not a whole number"),
    ("steps: 2.5\n", "steps: 2.5: '2.5' is not a whole number"),
    ("steps: 0\n", "steps: 0: 0 must be >= 1"),
    ("lr: .inf\n", "lr: inf: 'inf' must be a finite number > 0: the peak learning rate"),
    ("compile: 'yes'\n", "compile: 'yes': must be true or false"),
    ("backend: cuda\n", "backend: 'cuda': must be one of torch, triton, auto"),
    ("model: 7\n", "model: 7: must be text"),
    ("seq_len: null\n", "seq_len: None: must be given"),
    ("- steps: 2\n", "holds a list, not a mapping of settings"),
    ("steps: [2\n", "not valid YAML"),
])
def test_bad_config_files_name_the_file_the_key_and_the_value(tmp_path, text, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit) as e:
        parse_args(["train", "--config", path])
    assert str(e.value).startswith(f"oomb train: error: --config {path}: ") and message in str(e.value), e.value
    with pytest.raises(SystemExit, match=r"--config .*run.toml: a .yaml, .yml or .json file is read"):
        parse_args(["train", "--config", write(tmp_path / "run.toml", "steps = 2")])
    with pytest.raises(SystemExit, match=r"--config .*missing.yaml: cannot read it \(No such file"):
        parse_args(["train", "--config", str(tmp_path / "missing.yaml")])


def losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_writes_its_resolved_config_and_a_config_run_repeats_it(tmp_path, capsys):
    """chunk_size, kv_grad_dtype, checkpoint_layers (oomb.auto), compile, backend, dtype and device
    are written as the run used them; `--config` of the file runs the same steps (the same losses,
    bit for bit) with nothing left to choose."""
    first, second = tmp_path / "a", tmp_path / "b"
    main(["train", *TINY, "--output-dir", str(first)])
    assert "auto configuration" in capsys.readouterr().out
    resolved = yaml.safe_load((first / "config.yaml").read_text())
    assert list(resolved) == list(FIELDS)
    assert resolved["chunk_size"] in (16, 32) and resolved["kv_grad_dtype"] in ("float32", "bfloat16")
    assert isinstance(resolved["checkpoint_layers"], bool) and resolved["compile"] is False
    assert (resolved["backend"], resolved["dtype"], resolved["device"]) == ("torch", "float32", "cpu")
    assert resolved["needle_template"] == TrainConfig().needle_template and resolved["overwrite"] is False
    main(["train", "--config", str(first / "config.yaml"), "--output-dir", str(second)])
    assert "auto configuration" not in capsys.readouterr().out  # every choice was in the file
    assert losses(second) == losses(first) and len(losses(first)) == 2
    again = yaml.safe_load((second / "config.yaml").read_text())
    assert again == {**resolved, "output_dir": str(second)}
    main(["plan", "--config", str(first / "config.yaml")])  # plans the step the run took: nothing to choose
    out = capsys.readouterr().out
    assert out.startswith(f"tiny: 1 x 64 tokens, chunk {resolved['chunk_size']}, page 16,")
    assert "auto configuration" not in out
