"""Context extension flags (models/rope.py): the config transformers reads, the same logits."""
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import oomb
from oomb.models.rope import RopeScaling, check_positions
from oomb.presets import load_config, load_model, load_tokenizer
from tiny_models import VOCAB, make_model


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("theta,scaling,params", [
    (40_000.0, None, {"rope_type": "default", "rope_theta": 40_000.0}),
    (None, "linear:4", {"rope_type": "linear", "factor": 4.0}),
    (None, "dynamic:2", {"rope_type": "dynamic", "factor": 2.0}),
    (80_000.0, "yarn:4", {"rope_type": "yarn", "rope_theta": 80_000.0, "factor": 4.0,
                          "original_max_position_embeddings": 256}),
    (None, "llama3:8:128", {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 128,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])
def test_rope_flags_give_transformers_logits(tmp_path, family, theta, scaling, params):
    """A checkpoint loaded with --rope-theta / --rope-scaling computes what transformers computes
    with the same rope_parameters (and the engine what that model computes); the exported config
    keeps them."""
    model = make_model(family)
    model.config.max_position_embeddings = 256
    model.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), rope_theta=theta, rope_scaling=scaling)
    base = dict(model.config.rope_parameters)
    expected = {"rope_theta": base["rope_theta"], **params}
    assert {k: ours.config.rope_parameters[k] for k in expected} == expected
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={**expected})
    ids = torch.randint(0, VOCAB, (1, 600), generator=torch.Generator().manual_seed(0))  # past 256 positions
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, ref(input_ids=ids).logits
        plain = model(input_ids=ids).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, plain, atol=1e-4)  # the flags changed the positions' rotation
    engine = oomb.ChunkRecurrentEngine(ours, chunk_size=128, page_size=32, backend="torch", kv_grad_dtype=None)
    r = engine.evaluate(ids, per_token=True)
    ce = torch.nn.functional.cross_entropy(b[0, :-1].float(), ids[0, 1:], reduction="none")
    assert torch.allclose(r.token_losses[0, 1:], ce, atol=1e-5)
    ours.save_pretrained(tmp_path / "exported")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert {k: again.config.rope_parameters[k] for k in expected} == expected


def test_rope_errors_and_warnings():
    with pytest.raises(ValueError, match="must be TYPE:FACTOR .* one of linear, dynamic, yarn, llama3"):
        RopeScaling.parse("ntk:2")
    with pytest.raises(ValueError, match="FACTOR=0.5 must be > 1"):
        RopeScaling.parse("yarn:0.5")
    with pytest.raises(ValueError, match="GptOssForCausalLM supports yarn"):
        load_config("gpt-oss-20b", rope_scaling="linear:2")
    gpt = load_config("gpt-oss-20b", rope_scaling="yarn:2")  # yarn 32 -> 64 on the same original length
    assert gpt.rope_parameters["factor"] == 64 and gpt.max_position_embeddings == 64 * 4096
    with pytest.raises(ValueError, match="--rope-theta -1 must be > 0"):
        load_config("tiny", rope_theta=-1.0)
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096
    with pytest.warns(UserWarning, match="seq_len=8,192 exceeds the model's max_position_embeddings=4,096"):
        check_positions(cfg, 8192, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_positions(cfg, 8192, 40_000.0, None)  # extended: no warning
        check_positions(cfg, 4096, None, None)
    gemma = load_config("gemma-3-4b")  # RoPE per layer type: no flag extends it, none is suggested
    with pytest.warns(UserWarning, match=r"=131,072 .* RoPE is set per layer type: --rope-theta / --rope-scaling"):
        check_positions(gemma, 262_144, None, None)
    with pytest.raises(ValueError, match=r"Gemma3TextConfig has no single rope_parameters dict \(per-layer RoPE\)"):
        load_config("gemma-3-4b", rope_theta=1e7)
    with pytest.raises(ValueError, match="neither a preset nor a local checkpoint directory; presets: tiny"):
        load_config("no-such-model")


def test_names_that_are_not_checkpoints_never_reach_the_hub(tmp_path, monkeypatch):
    """A preset has no tokenizer and a bare name is no checkpoint: both are refused at once (offline,
    transformers retries the hub for ~45 s); a directory named without a slash is a checkpoint."""
    import transformers

    def hub(*args, **kwargs):
        raise AssertionError(f"AutoTokenizer.from_pretrained{args} was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    with pytest.raises(ValueError, match="'tiny' is a preset: random weights and no tokenizer"):
        load_tokenizer("tiny")
    with pytest.raises(ValueError, match="'no-such-model' is neither a local checkpoint directory nor an org/name"):
        load_tokenizer("no-such-model")
    monkeypatch.undo()
    load_config("tiny").save_pretrained(tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    assert load_config("mine").hidden_size == load_config("tiny").hidden_size
