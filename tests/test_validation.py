"""Every number and file a run is given is checked before compute, with one line that names the
value, the limit and the fix; weights are checked finite before they are written."""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from oomb.cli import main
from oomb.train.config import TrainConfig
from oomb.train.interrupt import TrainingStopped
from oomb.units import parse_bytes, parse_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(seq_len=64, chunk_size=32, page_size=16, backend="torch", device="cpu", log_every=10)


@pytest.mark.parametrize("kwargs,message", [
    ({"grad_clip": -1.0}, "grad_clip=-1.0 must be >= 0 and finite: the largest gradient norm, e.g. 1.0 (0: no "
                          "clipping, the norm still logged)"),
    ({"grad_clip": math.nan}, "grad_clip=nan must be >= 0 and finite"),
    ({"lr": math.inf}, "lr=inf must be > 0 and finite: the peak learning rate, e.g. 3e-4"),
    ({"lr": math.nan}, "lr=nan must be > 0 and finite"),
    ({"lr": -1e-3}, "lr=-0.001 must be > 0 and finite"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0 and finite: AdamW's decoupled weight decay, e.g. 0.1"),
    ({"weight_decay": math.inf}, "weight_decay=inf must be >= 0 and finite"),
    ({"lr": 0.1, "weight_decay": 10.0}, "weight_decay=10 with lr=0.1: AdamW multiplies every weight by 1 - lr x "
                                        "weight_decay = 0 each step, which must stay above 0; lower --weight-decay"),
    ({"rope_theta": math.nan}, "rope_theta=nan must be > 0 and finite: the new RoPE base, e.g. 8x the model's"),
    ({"rope_theta": 0.0}, "rope_theta=0.0 must be > 0 and finite"),
    ({"rope_scaling": "yarn:inf"}, "--rope-scaling 'yarn:inf': FACTOR=inf must be > 1 and finite (it extends the "
                                   "context by that much), e.g. yarn:4"),
    ({"rope_scaling": "linear:nan"}, "--rope-scaling 'linear:nan': FACTOR=nan must be > 1 and finite"),
    ({"seq_len": math.inf}, "seq_len=inf must be a whole number >= 2"),
    ({"steps": 2.5}, "steps=2.5 must be a whole number >= 1"),
    ({"steps": 0}, "steps=0 must be >= 1"),
    ({"seed": -1}, "seed=-1 must be >= 0"),
    ({"seed": 2**64}, "seed=18446744073709551616 must be < 2**63"),
    ({"sparse_chunk_budget": -1}, "sparse_chunk_budget=-1 must be >= 0"),
    ({"sparse_sink_pages": -1}, "sparse_sink_pages=-1 must be >= 0"),
    ({"needles_per_sequence": 0}, "needles_per_sequence=0 must be >= 1"),
    ({"needle_rate": math.nan}, "needle_rate=nan must be >= 0 and finite: the share of sequences with needles, at "
                                "most 1"),
    ({"lora_alpha": 0.0}, "lora_alpha=0.0 must be > 0 and finite"),
    ({"kept_host_gib": math.inf}, "kept_host_gib=inf must be >= 0 and finite"),
    ({"data": "chats.jsonl"}, "--data chats.jsonl is not a token file (.npy or .bin) nor 'copy'; tokenise it first: "
                              "oomb tokenize chats.jsonl --model MODEL --output chats.npy (it reads .txt, .jsonl, "
                              ".json, .parquet)"),
    ({"data": "notes.txt"}, "--data notes.txt is not a token file (.npy or .bin)"),
    ({"data": "rows.parquet"}, "--data rows.parquet is not a token file (.npy or .bin)"),
    ({"data": "table.csv"}, "--data table.csv is not a token file (.npy or .bin)"),
    ({"eval_data": "held.json"}, "--eval-data held.json is not a token file (.npy or .bin)"),
])
def test_bad_numbers_and_data_names_are_refused(kwargs, message):
    with pytest.raises(ValueError) as e:
        TrainConfig(**kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_grad_clip_zero_is_no_clipping_with_the_norm_logged():
    """As transformers' max_grad_norm=0: the gradients are left as they are, their norm returned."""
    from oomb.parallel import clip_grad_norm_

    TrainConfig(grad_clip=0.0)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 2.0), torch.full((4,), -1.0)
    norm = clip_grad_norm_(params, 0.0)
    assert norm == pytest.approx(4.0)
    assert torch.equal(params[0].grad, torch.full((3,), 2.0)) and torch.equal(params[1].grad, torch.full((4,), -1.0))
    assert clip_grad_norm_(params, 1.0) == pytest.approx(4.0) and params[0].grad[0] == pytest.approx(0.5)


@pytest.mark.parametrize("text", ["inf", "nan", "0", "-5", "1e999", "0.5", "100.5", "0.1K", "abc", "-1M", ""])
def test_token_counts_are_whole_and_positive(text):
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^{text!r} is not a whole number of tokens >= 1; use e.g. "
                                                        "4096, 64K or 1M$"):
        parse_tokens(text)
    assert parse_tokens("1.5K") == 1536 and parse_tokens("0", low=0) == 0


@pytest.mark.parametrize("text", ["infGiB", "nanGiB", "-1GiB", "1e999GB"])
def test_sizes_are_finite_and_not_negative(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}' is not a size; use e.g. 139.8GiB"):
        parse_bytes(text)


@pytest.mark.parametrize("argv,message", [
    (["plan", "--seq-len", "0"], "argument --seq-len: '0' is not a whole number of tokens >= 2"),
    (["plan", "--seq-len", "inf"], "argument --seq-len: 'inf' is not a whole number of tokens >= 2"),
    (["plan", "--batch", "0"], "argument --batch: 0 must be >= 1"),
    (["plan", "--chunk-size", "-4"], "argument --chunk-size: -4 must be >= 1"),
    (["plan", "--tp", "0"], "argument --tp: 0 must be >= 1"),
    (["plan", "--gpu-memory", "infGiB"], "argument --gpu-memory: 'infGiB' is not a size"),
    (["train", "--seq-len", "nan"], "argument --seq-len: 'nan' is not a whole number of tokens >= 2"),
    (["train", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["train", "--lr", "inf"], "argument --lr: 'inf' must be a finite number > 0: the peak learning rate, e.g. 3e-4"),
    (["train", "--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    (["eval", "--chunk-size", "0"], "argument --chunk-size: 0 must be >= 1"),
    (["eval", "--rope-theta", "nan"], "argument --rope-theta: 'nan' must be a finite number > 0"),
    (["eval", "--depths", "0,1.5"], "argument --depths: '0,1.5' must be depths from 0 (start) to 1 (end)"),
    (["eval", "--lengths", "4K,0"], "argument --lengths: '0' is not a whole number of tokens >= 1"),
    (["eval", "--buckets", "0,-1"], "argument --buckets: '-1' is not a whole number of tokens >= 0"),
    (["eval", "--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["corpus", "--output", "x", "--max-size=-3MiB"], "argument --max-size: '-3MiB' is not a size"),
])
def test_flags_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def run_cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "oomb.cli", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), **(env or {})})


def test_command_lines_end_in_one_line_not_a_trace():
    """End to end: the bad input's line is the last one, no stack trace; no model is built first."""
    cases = [(["train", "--lr", "inf"], "oomb train: error: argument --lr: 'inf' must be a finite number > 0"),
             (["train", "--grad-clip", "-1"], "oomb train: error: argument --grad-clip: '-1' must be a finite number "
                                              ">= 0"),
             (["train", "--weight-decay", "10", "--lr", "0.1"], "oomb train: error: weight_decay=10 with lr=0.1"),
             (["train", "--rope-scaling", "yarn:inf"], "oomb train: error: --rope-scaling 'yarn:inf': FACTOR=inf"),
             (["train", "--data", "chats.jsonl"], "oomb train: error: --data chats.jsonl is not a token file"),
             (["plan", "--seq-len", "0"], "oomb plan: error: argument --seq-len: '0' is not a whole number of tokens"),
             (["eval", "--data", "chats.jsonl"], "oomb eval: error: --data chats.jsonl is not a token file")]
    for argv, message in cases:
        out = run_cli(*argv)
        assert out.returncode in (1, 2) and out.stderr.strip().splitlines()[-1].startswith(message), (argv, out.stderr)
        assert "Traceback" not in out.stderr


def test_triton_backend_without_a_gpu_is_one_line():
    """Off CUDA the triton backend runs only under Triton's interpreter (TRITON_INTERPRET=1, the
    CPU tests' setting); without it, one line instead of the driver's traceback."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the triton backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "train", "--backend", "triton", "--device", "cpu",
                          "--steps", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "oomb train: error: backend='triton' runs CUDA kernels and this run is on cpu; use backend 'torch' "
        "(--backend torch, or auto: torch off CUDA)")
    from oomb.attention import resolve_backend

    assert resolve_backend("triton", torch.device("cpu")).name == "triton"  # interpreted here (conftest)


def test_a_model_too_big_for_memory_is_refused_before_it_is_built(monkeypatch):
    from oomb.memory import pinned
    from oomb.train.checks import check_model_fits

    monkeypatch.setattr(pinned, "available_host_bytes", lambda: 24 * 2**30)
    with pytest.raises(ValueError) as e:
        check_model_fits(TrainConfig(model="qwen2.5-7b"), torch.device("cpu"))
    assert str(e.value) == (
        "--model qwen2.5-7b: 7.62B parameters need 113.5 GiB for their weights, gradients and optimizer state in "
        "float32 on cpu, more than the 24.0 GiB free there; use a smaller model, --lora-rank 16, --dtype bfloat16 or "
        "a machine with more memory")
    with pytest.raises(ValueError, match="need 28.4 GiB for their weights in float32"):
        check_model_fits(TrainConfig(model="qwen2.5-7b", lora_rank=16), torch.device("cpu"))
    check_model_fits(TrainConfig(model="qwen2.5-0.5b"), torch.device("cpu"))  # 7.9 GiB: fits


def test_negative_token_ids_are_refused_with_the_file(tmp_path):
    from oomb.data.documents import open_documents, sibling
    from oomb.data.tokens import open_tokens

    ids = np.arange(40, dtype=np.int32) % 7
    ids[9] = -3
    np.save(tmp_path / "neg.npy", ids)
    with pytest.raises(ValueError, match=rf"^{tmp_path}/neg.npy has token id -3 < 0 at index 9: token ids are >= 0"):
        open_tokens(tmp_path / "neg.npy", 256)
    ids.tofile(tmp_path / "neg.bin")
    with pytest.raises(ValueError, match="neg.bin has token id -3 < 0 at index 9"):
        open_tokens(tmp_path / "neg.bin", 256, "int32")
    np.save(sibling(tmp_path / "neg.npy", "docs"), np.array([0, 5, 20]))
    with pytest.raises(ValueError, match=r"neg.npy: document 1 \(from token 5\) has token id -3 < 0"):
        open_documents(str(tmp_path / "neg.npy"), 256)
    (tmp_path / "chats.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="chats.jsonl is not a token file .* oomb tokenize"):
        open_tokens(tmp_path / "chats.jsonl", 256)


def test_output_folders_are_made_or_refused_before_the_work(tmp_path, capsys):
    from oomb.train.corpus import build_corpus

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=rf"^oomb eval: error: --plot {blocker}/p.png: cannot create the folder "
                                         rf"'{blocker}' \(File exists\); choose another path$"):
        main(["eval", "--task", "position-loss", "--plot", f"{blocker}/p.png", "--json"])
    assert capsys.readouterr().out == ""  # refused before the evaluation, not after it
    with pytest.raises(ValueError, match=rf"--output {blocker}/c: cannot create the folder '{blocker}/c' \(Not a "
                                         r"directory\)"):
        build_corpus(blocker / "c", roots=[tmp_path], heldout=0.5)
    main(["eval", "--task", "position-loss", "--seq-len", "64", "--chunk-size", "32", "--page-size", "16",
          "--batches", "1", "--plot", str(tmp_path / "new" / "dir" / "p.png")])
    assert (tmp_path / "new" / "dir" / "p.png").is_file()


def test_tokenize_makes_its_output_folder_and_refuses_unknown_roles(tmp_path):
    from test_data_sources import CHAT, word_tokenizer, write_jsonl

    from oomb.train.sources import tokenize

    ckpt = word_tokenizer(tmp_path / "words")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    out = tmp_path / "missing" / "folder" / "c.npy"
    assert tokenize(ckpt, [data], str(out))["chats"] == 1 and out.is_file()
    with pytest.raises(ValueError, match=rf"^--output {out}/x.npy: cannot create the folder '{out}' \(File exists\); "
                                         "choose another path$"):
        tokenize(ckpt, [data], str(out / "x.npy"))
    # a template that renders the roles it knows and drops the others (as Qwen's drops "bot")
    known = word_tokenizer(tmp_path / "known", template=(
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    bot = [*CHAT[:2], {"role": "bot", "content": "the cat sat"}, *CHAT[3:]]
    data = write_jsonl(tmp_path / "bot.jsonl", [{"messages": CHAT}, {"messages": bot}])
    with pytest.raises(ValueError) as e:
        tokenize(known, [data], str(tmp_path / "bot.npy"))
    assert str(e.value) == (f"{data}:2: messages[2] has role 'bot', which the chat template leaves out (its content "
                            "is not in the rendered text); use one of system, user, assistant or a role the template "
                            "renders (e.g. tool)")
    assert tokenize(ckpt, [data], str(tmp_path / "bot.npy"))["chats"] == 2  # a template that renders it: kept


def test_non_finite_weights_are_not_saved(tmp_path, monkeypatch):
    """An update that leaves a NaN in the weights: no checkpoint of them, the step named."""
    from oomb.train.checks import check_finite_weights
    from oomb.train.trainer import train

    model = torch.nn.Linear(2, 2)
    check_finite_weights(model, 3, [1.0, 1.0, 1.0], TrainConfig())
    with torch.no_grad():
        model.weight[0, 1] = math.inf
    with pytest.raises(TrainingStopped, match=r"^not saving the weights of step 3: 1 of 2 trainable tensors hold NaN "
                                              r"or infinity \(e.g. weight\); they went non-finite in the update of "
                                              r"step 2, the last with a finite loss. Lower --lr \(now 0.005\)"):
        check_finite_weights(model, 3, [1.0, 1.0, math.nan], TrainConfig())

    step = torch.optim.AdamW.step

    def poisoned(self, *args, **kwargs):  # the second update makes one weight NaN
        out = step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 2:
            self.param_groups[0]["params"][0].data[0] = math.nan
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(TrainingStopped, match=r"not saving the weights of step 2: 1 of \d+ trainable tensors hold NaN "
                                              r"or infinity \(e.g. model.embed_tokens.weight\); they went non-finite "
                                              "in the update of step 2"):
        train(TrainConfig(steps=3, save_every=2, output_dir=str(tmp_path / "run"), **SMALL))
    assert not list((tmp_path / "run").glob("step-*"))


def test_a_resume_with_another_lr_or_schedule_says_what_it_keeps(tmp_path, capsys):
    from oomb.train.trainer import train

    out = str(tmp_path / "run")
    train(TrainConfig(steps=2, output_dir=out, **SMALL))
    capsys.readouterr()
    train(TrainConfig(steps=3, lr=5e-2, output_dir=out, resume=f"{out}/step-000002", **SMALL))
    lines = [x for x in capsys.readouterr().out.splitlines() if "--resume" in x]
    assert lines == [f"oomb train: --resume {out}/step-000002 keeps the checkpoint's lr=0.005 (--lr 0.05 is not "
                     "applied); its schedule follows --steps 3 (was 2) from here"]
    train(TrainConfig(steps=3, output_dir=out, resume=f"{out}/step-000003", **SMALL))
    assert "--resume" not in capsys.readouterr().out  # nothing differs: nothing said
    assert json.loads((tmp_path / "run" / "step-000003" / "trainer.json").read_text())["step"] == 3
