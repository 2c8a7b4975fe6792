"""fp32 master weights (`--master-weights float32`, oomb.train.master): bf16 compute, fp32 updates
that match transformers with fp32 weights under bf16 autocast, exact resume, the plan's bytes and
the refusals."""
import json

import pytest
import torch
from safetensors.torch import load_file

from oomb.train.config import TrainConfig
from oomb.train.trainer import build_model, lr_lambda, train

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, backend="torch", device="cpu", dtype="bfloat16")


def reference_updates(cfg: TrainConfig, steps: int) -> tuple[dict, dict, list, list]:
    """transformers' model with fp32 weights (the trainer's bf16 initial weights, widened), its
    forward and backward under torch.autocast(bf16), the trainer's AdamW, clipping and schedule,
    on the trainer's batches: (initial weights, weights after `steps`, losses, gradient norms)."""
    from oomb.train.data import make_data

    torch.manual_seed(cfg.seed)  # as train() does before it builds the model
    model = build_model(cfg, torch.device("cpu")).float()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    data = make_data(cfg.data, model.config.vocab_size, cfg.seq_len, cfg.batch, seed=cfg.seed)
    losses, norms = [], []
    for _ in range(steps):
        ids, labels = next(data)[:2]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return w0, {n: p.detach() for n, p in model.named_parameters()}, losses, norms


def update_error(w0: dict, ref: dict, got: dict, names) -> float:
    """||got - ref|| / ||ref - w0|| over `names`: the updates' relative difference."""
    num = sum(float((got[n] - ref[n]).pow(2).sum()) for n in names)
    return (num / sum(float((ref[n] - w0[n]).pow(2).sum()) for n in names)) ** 0.5


def test_master_weights_match_transformers_fp32_weights_under_bf16_autocast(tmp_path):
    """Two steps of oomb train --master-weights float32 (bf16 weights, chunked bf16 compute, fp32
    gradient sums handed to fp32 masters) against transformers in fp32 under bf16 autocast: losses
    within 1e-3, gradient norms within 2e-3, and the masters' updates within 6 % (8 % per tensor).

    The 6 % is bf16 itself, not the chunking: transformers with bf16 weights and fp32 masters,
    one unchunked backward, differs from its autocast run by 3.9 % (5.4 % worst tensor) on these
    steps, where oomb differs by 3.8 % (5.6 %); at lr=1e-3, 4.1 % (5.5 %) and 4.2 % (5.8 %).
    Autocast keeps softmax, norms and the loss in fp32 where bf16 weights round each op's output. Adam's first steps are about lr x sign(gradient),
    so the difference counts the few elements (< 0.3 %) whose small gradients flip sign. k_proj's
    bias is left out: its exact gradient is zero (softmax ignores a shift shared by every key), so
    both runs' updates of it are Adam-normalised rounding noise. Without masters, bf16 weights
    round updates of lr=1e-4 away: their update differs by 40 %."""
    cfg = dict(**SMALL, steps=2, lr=1e-4, warmup_steps=0, lr_schedule="constant", weight_decay=0.1)
    out = tmp_path / "run"
    losses = train(TrainConfig(**cfg, master_weights="float32", output_dir=str(out)))
    w0, ref, ref_losses, ref_norms = reference_updates(TrainConfig(**cfg), 2)
    masters = load_file(out / "step-000002" / "master-weights.safetensors")
    assert all(t.dtype == torch.float32 for t in masters.values())
    norms = [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    assert norms == pytest.approx(ref_norms, rel=2e-3)
    names = [n for n in ref if "k_proj.bias" not in n]
    assert update_error(w0, ref, masters, names) < 0.06
    assert max(update_error(w0, ref, masters, [n]) for n in names) < 0.08
    # the weights the layers ran on, the checkpoint's and final/ (the model's dtype): the masters rounded
    for weights in (load_file(out / "step-000002" / "model.safetensors"), load_file(out / "final" / "model.safetensors")):
        assert all(torch.equal(weights[n], masters[n].to(torch.bfloat16)) for n in masters)
    plain = tmp_path / "plain"
    train(TrainConfig(**cfg, output_dir=str(plain)))
    bf16 = {n: t.float() for n, t in load_file(plain / "step-000002" / "model.safetensors").items()}
    assert update_error(w0, ref, bf16, names) > 3 * update_error(w0, ref, masters, names)


def test_master_weights_resume_exactly(tmp_path):
    """4 steps in one run equal 2 steps, a checkpoint, and 2 resumed steps, bit for bit: the
    losses, the fp32 masters, the bf16 weights and AdamW's fp32 state."""
    cfg = dict(**SMALL, steps=4, lr=1e-3, master_weights="float32")
    full = train(TrainConfig(**cfg, output_dir=str(tmp_path / "full"), save_every=2))
    half = tmp_path / "half"
    train(TrainConfig(**{**cfg, "steps": 2}, output_dir=str(half)))
    resumed = train(TrainConfig(**cfg, output_dir=str(half), resume=str(half / "step-000002")))
    assert resumed == full[2:]
    a, b = tmp_path / "full" / "step-000004", half / "step-000004"
    for name in ("master-weights.safetensors", "model.safetensors"):
        x, y = load_file(a / name), load_file(b / name)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    xo, yo = (torch.load(d / "optimizer.pt", weights_only=True)["optimizer"]["state"] for d in (a, b))
    assert all(torch.equal(xo[i][k], yo[i][k]) for i in xo for k in xo[i])
    assert all(t.dtype == torch.float32 for s in xo.values() for k, t in s.items() if k != "step")
    # a checkpoint of a run without masters is not continued with them (nor the other way)
    with pytest.raises(ValueError, match="master_weights: 'float32' there, 'none' here"):
        train(TrainConfig(**SMALL, steps=4, lr=1e-3, resume=str(half / "step-000002")))


def test_plan_counts_master_weights_and_their_fp32_state():
    """4 B of fp32 master a trainable parameter, and AdamW's moments fp32 (8 B where bf16 weights
    have 4); the trainer's plan arguments measure the same, and oomb plan prints the row."""
    from oomb.plan import plan
    from oomb.presets import load_config
    from oomb.train.trainer import make_optimizer, plan_args
    from oomb.train.master import MasterWeights

    config = load_config("qwen2.5-0.5b")
    plain = plan(config, 65536, chunk_size=4096, param_grad_dtype=torch.float32)
    mixed = plan(config, 65536, chunk_size=4096, param_grad_dtype=torch.float32, master_weights=True)
    n = plain.weights // 2
    assert (mixed.masters, mixed.optimizer, plain.masters, plain.optimizer) == (4 * n, 8 * n, 0, 4 * n)
    assert mixed.grads == plain.grads == 4 * n  # the fp32 sums, with or without masters
    assert mixed.beside_pages - plain.beside_pages == 8 * n
    assert mixed.total - plain.total == 8 * n

    cfg = TrainConfig(**SMALL, master_weights="float32")
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    masters = MasterWeights(model, wide_grads=True)
    args = plan_args(model, make_optimizer(masters.masters, cfg), cfg)
    assert args["optimizer_bytes_per_param"] == 8 and args["master_weights"] is True


def test_oomb_plan_prints_master_weights(capsys):
    from oomb.cli import main

    main(["plan", "--model", "qwen2.5-0.5b", "--seq-len", "64K", "--master-weights", "float32", "--chunk-size",
          "4096", "--kv-grad-dtype", "bfloat16", "--no-checkpoint-layers"])
    out = capsys.readouterr().out
    assert "fp32 master weights" in out.splitlines()[0]
    assert any(line.startswith("fp32 master weights ") for line in out.splitlines())
    with pytest.raises(SystemExit, match=r"master_weights='float32' \(fp32 copies of bf16 weights\) with "
                                         r"lora_rank=8: LoRA's adapters are fp32 already"):
        main(["plan", "--model", "qwen2.5-0.5b", "--seq-len", "64K", "--master-weights", "float32",
              "--lora-rank", "8"])


@pytest.mark.parametrize("settings, message", [
    ({"dtype": "float32"}, "--dtype float32: the weights are already fp32"),
    ({"lora_rank": 4}, "LoRA's adapters are fp32 already"),
    ({"optimizer": "adamw8bit"}, "use --optimizer adamw"),
    ({"tp": 2}, "not built for tensor-parallel"),
])
def test_master_weights_refusals(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{**SMALL, **settings, "master_weights": "float32"})


def test_master_weights_refused_on_fp32_weights_before_compute(tmp_path):
    """dtype auto is fp32 on the CPU: refused before the model is built or anything written."""
    with pytest.raises(ValueError, match=r"the weights are float32 here \(--dtype auto on the CPU\)"):
        train(TrainConfig(**{**SMALL, "dtype": "auto"}, master_weights="float32", output_dir=str(tmp_path / "r")))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_fp32_weights_on_cuda_point_to_master_weights():
    """A full-parameter run with fp32 weights on CUDA (where bf16 is the default) prints what it
    costs and the setting that keeps fp32 masters at bf16 speed; bf16, LoRA and the CPU print nothing."""
    from oomb.train.checks import float32_note

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    note = float32_note(TrainConfig(dtype="float32"), cuda)
    assert "~40x slower" in note and "--dtype bfloat16 --master-weights float32" in note
    assert float32_note(TrainConfig(dtype="auto"), cuda) == float32_note(TrainConfig(dtype="auto"), cpu) == ""
    assert float32_note(TrainConfig(dtype="float32", lora_rank=8), cuda) == ""
