"""The trainer and CLI end to end on the tiny preset (CPU, seconds)."""
import json
import subprocess
import sys

import pytest
import torch

from oomb.cli import main, parse_tokens
from oomb.train.config import TrainConfig
from oomb.train.trainer import train

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=3, backend="torch", device="cpu")


def test_train_runs_and_loss_falls():
    # The Zipf half of the copy task is learnt within a few dozen steps.
    losses = train(TrainConfig(**{**SMALL, "steps": 25, "lr": 1e-2}))
    assert len(losses) == 25 and all(map(lambda x: x == x, losses))
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses


def test_checkpoint_is_atomic_and_resumes(tmp_path):
    cfg = TrainConfig(**SMALL, output_dir=str(tmp_path), save_every=2, lora_rank=4)
    train(cfg)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step-000002", "step-000003"]  # no *.tmp left behind
    state = json.loads((tmp_path / "step-000002" / "trainer.json").read_text())
    assert state["step"] == 2 and state["config"]["lora_rank"] == 4
    # Resuming from step 2 runs exactly one more step.
    losses = train(TrainConfig(**SMALL, lora_rank=4, resume=str(tmp_path / "step-000002")))
    assert len(losses) == 1


def test_offload_all_with_bf16_gradient_pages_trains():
    losses = train(TrainConfig(**SMALL, offload="all", kv_grad_dtype="bfloat16"))
    assert len(losses) == 3 and all(x == x for x in losses)


def test_resume_from_a_non_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        train(TrainConfig(**SMALL, resume=str(tmp_path)))


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="seq_len=1 must be >= 2"):
        TrainConfig(seq_len=1)
    with pytest.raises(ValueError, match="lr=0.0 must be > 0"):
        TrainConfig(lr=0.0)


def test_cli_user_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--chunk-size", "100", "--page-size", "64", "--steps", "1", "--seq-len", "256"])
    assert "oomb train: error: chunk_size=100 is not a multiple of page_size=64" in str(e.value)


def test_cli_plan_json():
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "plan", "--model", "qwen2.5-7b", "--seq-len", "64K",
                          "--json"], capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    # 15 full chunks stored x 28 layers x 4 KV heads x 128 x (2 B K/V + 4 B dK/dV) x 2
    assert plan["pages"] == 15 * 4096 * 28 * 4 * 128 * 2 * (2 + 4)
    # the parameter count is exact: compare with the model itself, built on the meta device
    from transformers import AutoModelForCausalLM

    from oomb.presets import preset_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("qwen2.5-7b"))
    assert plan["weights"] == 2 * sum(p.numel() for p in model.parameters())


def test_cli_eval(capsys):
    main(["eval", "--seq-len", "512", "--batches", "1", "--chunk-size", "128", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 511 and abs(result["loss"] - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_parse_tokens():
    assert parse_tokens("1M") == 2**20 and parse_tokens("64k") == 65536 and parse_tokens("4096") == 4096
