"""What a run writes can be evaluated, planned and merged: a LoRA run's final/ and step-N load in
`oomb eval` and `oomb plan` as PEFT loads them, `oomb export --merge` gives the logits of base +
adapter, and a directory that is no model, or a base that cannot be drawn again, is refused in a line
(tiny models, CPU, seconds)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from oomb.cli import main
from oomb.train import checkpoint
from oomb.train.config import TrainConfig
from oomb.train.trainer import train

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=2, backend="torch", device="cpu")
EVAL = ["--seq-len", "256", "--chunk-size", "128", "--page-size", "64", "--backend", "torch", "--device", "cpu",
        "--batches", "1", "--json"]
CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run over the tiny preset (random weights), a checkpoint at each of its 2 steps."""
    out = tmp_path_factory.mktemp("lora")
    train(TrainConfig(**SMALL, lora_rank=4, output_dir=str(out), save_every=1))
    return out


def eval_loss(model, capsys) -> float:
    main(["eval", "--model", str(model), *EVAL])
    return json.loads(capsys.readouterr().out.splitlines()[-1])["loss"]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_final_and_steps_load_in_eval_and_plan_as_peft_loads_them(lora_run, capsys):
    import peft

    from oomb.presets import load_model

    final, step1, step2 = lora_run / "final", lora_run / "step-000001", lora_run / "step-000002"
    # A step-N is a PEFT adapter: PEFT's names, and the final one's tensors.
    ours, peft_file = load_file(step2 / "adapter_model.safetensors"), load_file(final / "adapter_model.safetensors")
    assert ours.keys() == peft_file.keys() and all(torch.equal(ours[k], peft_file[k]) for k in ours)
    assert json.loads((final / "base.json").read_text())["model"] == "tiny"
    ids = torch.randint(0, 256, (1, 64))
    for path in (final, step1):
        torch.manual_seed(0)  # the run's seed: the preset's random weights the adapter was trained on
        reference = peft.PeftModel.from_pretrained(load_model("tiny"), path).eval()
        assert torch.allclose(logits(load_model(str(path)).eval(), ids), logits(reference, ids), atol=1e-5)
    losses = [eval_loss(p, capsys) for p in (final, step1, step2)]
    assert losses[0] == losses[2] != losses[1]
    for path in (final, step1):
        main(["plan", "--model", str(path), "--seq-len", "1K", "--lora-rank", "4"])
        assert f"{path}: 1 x 1,024 tokens" in capsys.readouterr().out
        # without --lora-rank the plan counts the adapter's own LoRA (rank and targets), as PEFT holds it
        main(["plan", "--model", str(path), "--seq-len", "1K", "--json"])
        planned = json.loads(capsys.readouterr().out.splitlines()[-1])
        torch.manual_seed(0)
        adapter = peft.PeftModel.from_pretrained(load_model("tiny"), path, is_trainable=True)
        # fp32 gradient sums (--param-grad-dtype float32, the default) of every parameter PEFT trains
        assert planned["grads"] == 4 * sum(p.numel() for p in adapter.parameters() if p.requires_grad) > 0


def test_an_older_step_with_the_parameters_names_loads_and_resumes(lora_run, tmp_path, capsys):
    """A step-N as an older oomb wrote it (model.safetensors named as the parameters are, no
    adapter_config.json): eval loads it as the new one, and a run resumes from it."""
    import shutil

    old = tmp_path / "run" / "step-000001"
    shutil.copytree(lora_run / "step-000001", old)
    state = load_file(old / "adapter_model.safetensors")
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in state.items()}, old / "model.safetensors")
    for name in ("adapter_model.safetensors", "adapter_config.json", "base.json", "manifest.json"):
        (old / name).unlink()
    checkpoint._write_manifest(old)
    assert eval_loss(old, capsys) == eval_loss(lora_run / "step-000001", capsys)
    losses = train(TrainConfig(**SMALL, lora_rank=4, output_dir=str(tmp_path / "run"), resume=str(old)))
    assert len(losses) == 1 and losses[0] == pytest.approx(
        json.loads((lora_run / "metrics.jsonl").read_text().splitlines()[1])["loss"], rel=1e-6)


def test_merged_export_equals_base_plus_adapter(tmp_path, monkeypatch, capsys):
    """A LoRA run on a local checkpoint (given by a relative path): the adapter names the base by
    its absolute path and evaluates from anywhere; `oomb export step-N` is final/; `--merge` is one
    transformers checkpoint in the base's dtype whose logits are PeftModel's, with the base's
    tokenizer and chat template; a non-empty --output is refused unless --overwrite."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from tiny_models import make_model

    monkeypatch.chdir(tmp_path)
    make_model("qwen2", vocab=256).save_pretrained("base")
    words = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained("base")
    train(TrainConfig(**SMALL, model="base", lora_rank=4, lr=1e-2, output_dir="run", save_every=2))
    base = str(tmp_path / "base")
    assert json.loads((tmp_path / "run/final/adapter_config.json").read_text())["base_model_name_or_path"] == base

    main(["export", "run/step-000002", "--output", "adapter"])
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted(
        p.name for p in (tmp_path / "run/final").iterdir())
    exported, final = load_file("adapter/adapter_model.safetensors"), load_file("run/final/adapter_model.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    main(["export", "run/final", "--merge", "--output", "merged"])
    merged = AutoModelForCausalLM.from_pretrained("merged").eval()
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "run/final").eval()
    ids = torch.randint(0, 256, (2, 50))
    with reference.disable_adapter():
        assert not torch.allclose(logits(reference, ids), logits(merged, ids), atol=1e-3)  # the adapter was trained
    assert merged.dtype == torch.float32 and not any("lora" in n for n, _ in merged.named_parameters())
    assert (logits(merged, ids) - logits(reference, ids)).abs().max() <= 1e-5
    assert AutoTokenizer.from_pretrained("merged").chat_template == CHATML

    with pytest.raises(SystemExit, match="--output merged is not empty; give --overwrite"):
        main(["export", "run/final", "--merge", "--output", "merged"])
    main(["export", "run/step-000002", "--merge", "--output", "merged", "--overwrite"])
    assert not list(tmp_path.glob("merged.*"))  # published by a rename: nothing left aside
    with pytest.raises(SystemExit, match="holds the checkpoint run/final being exported"):
        main(["export", "run/final", "--output", "run", "--overwrite"])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert eval_loss(tmp_path / "run/final", capsys) == pytest.approx(eval_loss(tmp_path / "merged", capsys),
                                                                      rel=1e-5)


def test_what_is_no_model_or_cannot_be_drawn_again_is_refused_in_a_line(lora_run, tmp_path, capsys):
    import shutil

    with pytest.raises(SystemExit, match="is a directory with no model in it: it has no config.json .*; it is a "
                                         "run's output directory: give its final/ or one of its step-N"):
        main(["eval", "--model", str(lora_run), *EVAL])
    with pytest.raises(SystemExit, match="oomb plan: error: .* is a directory with no model in it"):
        main(["plan", "--model", str(tmp_path)])
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_run / "final", adapter)
    record = json.loads((adapter / "base.json").read_text())
    (adapter / "base.json").write_text(json.dumps({**record, "seed": 1}))
    with pytest.raises(SystemExit, match=r"the preset 'tiny''s random weights \(seed 1, cpu, float32\), and drawing "
                                         "them again here gives other weights"):
        main(["eval", "--model", str(adapter), *EVAL])
    if not torch.cuda.is_available():
        (adapter / "base.json").write_text(json.dumps({**record, "device": "cuda"}))
        with pytest.raises(SystemExit, match="drawn on a CUDA device with seed 0: they can be drawn again only on one"):
            main(["export", str(adapter), "--merge", "--output", str(tmp_path / "merged")])
    (adapter / "base.json").unlink()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(SystemExit, match="the adapter does not say which model it was trained on"):
        main(["eval", "--model", str(adapter), *EVAL])
    assert not (tmp_path / "merged").exists()
