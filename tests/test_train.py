"""The trainer and CLI end to end on the tiny preset (CPU, seconds)."""
import argparse
import json
import math
import subprocess
import sys

import pytest
import torch

import oomb
from oomb.cli import main
from oomb.train.config import TrainConfig
from oomb.train.trainer import train
from oomb.units import parse_tokens

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=3, backend="torch", device="cpu")


def test_train_runs_and_loss_falls():
    # The Zipf half of the copy task is learnt within a few dozen steps.
    losses = train(TrainConfig(**{**SMALL, "steps": 25, "lr": 1e-2}))
    assert len(losses) == 25 and all(map(lambda x: x == x, losses))
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses


def test_copy_task_run_ends_with_the_loss_of_each_half(tmp_path, capsys):
    """A run on the built-in copy task ends with one line: the held-out loss on the copied half
    and on the random first half (transformers' per-token cross entropy of the exported model on
    the same held-out batch), beside the unigram entropy (the mean surprisal of many sampled
    tokens); 3 steps learn no copying, and the line says so."""
    import re

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from oomb.data.tokens import copy_entropy, copy_task, copy_weights
    from oomb.train.trainer import heldout_batches

    cfg = TrainConfig(**SMALL, output_dir=str(tmp_path))
    threads = torch.get_num_threads()
    train(cfg)
    assert torch.get_num_threads() == threads  # the tiny model's one thread (cpu_threads) ends with the run
    last = capsys.readouterr().out.strip().splitlines()[-1]
    got = re.fullmatch(r"copy task \(held out\): loss ([\d.]+) on the copied half vs ([\d.]+) on the random first "
                       r"half \(unigram entropy ([\d.]+)\): the copy is not learnt yet .*", last)
    assert got, last
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    ids, _ = heldout_batches(cfg, 256, 0)[0]
    with torch.no_grad():  # position t predicts token t + 1; the copied half starts at token 128
        ce = F.cross_entropy(model(input_ids=ids).logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    assert float(got[1]) == pytest.approx(float(ce[:, 127:].mean()), abs=0.006)
    assert float(got[2]) == pytest.approx(float(ce[:, :127].mean()), abs=0.006)
    sample = next(copy_task(256, 2**16, 4, seed=5))[0][:, : 2**15]  # the first halves: independent draws
    p = copy_weights(256) / copy_weights(256).sum()
    assert float(got[3]) == pytest.approx(float(-p[sample].log().mean()), abs=0.02)
    assert float(got[3]) == pytest.approx(copy_entropy(256), abs=0.005)


def test_checkpoint_is_atomic_and_resumes(tmp_path):
    cfg = TrainConfig(**SMALL, output_dir=str(tmp_path), save_every=2, lora_rank=4)
    train(cfg)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == [".lock", "config.yaml", "final", "metrics.jsonl", "step-000002", "step-000003"]  # no temporary left behind
    state = json.loads((tmp_path / "step-000002" / "trainer.json").read_text())
    assert state["step"] == 2 and state["config"]["lora_rank"] == 4
    # Resuming from step 2 runs exactly one more step.
    losses = train(TrainConfig(**SMALL, lora_rank=4, resume=str(tmp_path / "step-000002"), output_dir=str(tmp_path)))
    assert len(losses) == 1
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the resumed run's step 3 in place of the first run's


def test_no_save_writes_only_the_metrics(tmp_path):
    train(TrainConfig(**SMALL, output_dir=str(tmp_path), save_every=1, save=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "config.yaml", "metrics.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["step_s"] > 0 for r in rows)


def test_sparse_minimum_memory_settings_train(capsys):
    """Top-k sparse attention with pages on the host, bf16 dK/dV and layer recomputation: the
    settings of the longest contexts, through the trainer."""
    losses = train(TrainConfig(**{**SMALL, "seq_len": 512}, sparse_budget=1, sparse_chunk_budget=2, offload="all",
                               kv_grad_dtype="bfloat16", checkpoint_layers=True))
    assert len(losses) == 3 and all(x == x for x in losses)
    assert "sparse top-1 pages attention" in capsys.readouterr().out
    with pytest.raises(ValueError, match="sparse_chunk_budget=2 must be >= sparse_budget=4"):
        TrainConfig(sparse_budget=4, sparse_chunk_budget=2)


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
    with pytest.raises(ValueError, match="optimizer='adam' must be one of"):
        TrainConfig(optimizer="adam")
    with pytest.raises(ValueError, match="optimizer='adamw8bit' with tp=2: .* use --optimizer adamw with --tp"):
        TrainConfig(optimizer="adamw8bit", tp=2)


def test_cli_user_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--chunk-size", "100", "--page-size", "64", "--steps", "1", "--seq-len", "256"])
    assert "oomb train: error: chunk_size=100 is not a multiple of page_size=64" in str(e.value)


def test_cli_warning_is_one_line_without_loading_bars(tmp_path):
    """`oomb eval` of a checkpoint past the positions it was trained for: the warning is one line
    (no Python source line under it) and transformers draws no "Loading weights" bar; stderr holds
    nothing else."""
    from oomb.presets import load_model

    model = load_model("tiny")
    model.config.max_position_embeddings = 256
    model.save_pretrained(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "eval", "--model", str(tmp_path / "ckpt"), "--seq-len",
                          "512", "--batches", "1", "--chunk-size", "128", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr == ("UserWarning: seq_len=512 exceeds the model's max_position_embeddings=256 and RoPE is not "
                          "extended: positions past 256 were never seen in training. Extend it with --rope-theta (e.g. "
                          "8x the base) or --rope-scaling yarn:2\n")


def test_cli_plan_json():
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "plan", "--model", "qwen2.5-7b", "--seq-len", "64K",
                          "--chunk-size", "4096", "--kv-grad-dtype", "float32", "--json"],
                         capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert "chunk 4096" in plan["auto"] and "(chosen:" in plan["auto"]  # layer recomputation was left to it
    # 15 full chunks stored x 28 layers x 4 KV heads x 128 x (2 B K/V + 4 B dK/dV) x 2
    assert plan["pages"] == 15 * 4096 * 28 * 4 * 128 * 2 * (2 + 4)
    # the parameter count is exact: compare with the model itself, built on the meta device
    from transformers import AutoModelForCausalLM

    from oomb.presets import preset_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("qwen2.5-7b"))
    assert plan["weights"] == 2 * sum(p.numel() for p in model.parameters())
    assert plan["optimizer"] == 4 * sum(p.numel() for p in model.parameters())  # AdamW: two bf16 moments
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "plan", "--model", "qwen2.5-7b", "--seq-len", "64K",
                          "--dp", "4", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["optimizer"] == plan["optimizer"] // 4  # ZeRO-1: a quarter per rank
    out = subprocess.run([sys.executable, "-m", "oomb.cli", "plan", "--model", "qwen2.5-7b", "--seq-len", "64K",
                          "--optimizer", "adamw8bit", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["optimizer"] == plan["optimizer"] // 2  # 8-bit moments


def test_cli_plan_4m_tokens_on_one_h200(capsys):
    """A 4,194,304-token step of the Qwen2.5-1.5B shape (top-k 64, bf16 dK/dV, layers recomputed,
    gradients only: bench/bench_step.py's step) fits one H200 (139.8 GiB, 5 % left free) with 110
    GiB of pinned host memory; with AdamW's state on the GPU one more layer's pages (8 GiB) go to the
    host, which then needs 120 GiB. A name that is neither a preset nor a directory is one error
    line (plan builds its config as train does: load_config)."""
    args = ["plan", "--model", "qwen2.5-1.5b", "--seq-len", "4M", "--offload", "auto", "--kv-grad-dtype", "bfloat16",
            "--sparse-budget", "64", "--checkpoint-layers"]
    for extra, fits in ((["--optimizer", "none", "--host-memory", "110GiB"], True),
                        (["--host-memory", "110GiB"], False), (["--host-memory", "120GiB"], True)):
        main(args + extra)
        out = capsys.readouterr().out
        assert "qwen2.5-1.5b: 1 x 4,194,304 tokens" in out and "139.8 GiB" in out
        assert (": fits" in out) == fits and ("do not fit this machine" in out) == (not fits), extra
        longest = int(out.rsplit("offload auto: ", 1)[1].split(" tokens")[0].replace(",", ""))
        assert (longest >= 4 * 2**20) == fits, extra
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "qwen2.5-1.5", "--seq-len", "4M"])
    assert "oomb plan: error: --model 'qwen2.5-1.5' is neither a preset nor a local checkpoint" in str(e.value)


def test_qwen_presets_are_the_published_shapes():
    """The Qwen2.5 presets build the published models' parameter counts (Qwen's model cards:
    0.5B 0.49B, 1.5B 1.54B, 3B 3.09B, 7B 7.61B; the small ones tie the head to the embedding)."""
    from oomb.plan import count_params
    from oomb.presets import preset_config
    sizes = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688,
             "qwen2.5-7b": 7_615_616_512}
    for name, n in sizes.items():
        cfg = preset_config(name)
        assert count_params(cfg) == n, name
        assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rms_norm_eps == 1e-6
        assert cfg.tie_word_embeddings == (name != "qwen2.5-7b")


def test_cli_eval(capsys):
    main(["eval", "--seq-len", "512", "--batches", "1", "--chunk-size", "128", "--device", "cpu", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("loss: tiny on copy, dense attention: loss ")  # the summary, then the JSON
    result = json.loads(out[-1])
    assert result["tokens"] == 511 and abs(result["loss"] - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_parse_tokens():
    assert parse_tokens("1M") == 2**20 and parse_tokens("64k") == 65536 and parse_tokens("4096") == 4096


def test_plan_placement_and_longest_context(capsys):
    """`oomb plan` splits pages as the engine does and finds the longest context that fits."""
    from oomb.plan import lora_params
    from oomb.units import parse_bytes
    from oomb.plan import gpu_margin, longest_context, place, plan
    from oomb.presets import preset_config
    cfg = preset_config("qwen2.5-7b")
    p = plan(cfg, 2**20, kv_grad_dtype=torch.bfloat16, optimizer_bytes_per_param=0)
    gib = 2**30
    fixed = p.weights + p.grads + p.working_set + gpu_margin(140 * gib)
    assert gpu_margin(140 * gib) == 7 * gib and gpu_margin(24 * gib) == 2 * gib  # 5 %, at least 2 GiB
    none = place(p, "none", 140 * gib, 110 * gib)
    assert none.gpu == fixed + p.pages and none.host == 0 and not none.fits  # 112 GiB of pages + 56 GiB
    every = place(p, "all", 140 * gib, 120 * gib)
    assert p.page_bytes == 4 * 128 * 128 * 2 * (2 + 2)  # K, V, dK, dV bf16
    assert p.staged_pages == 1024  # the engine's group_pages: two staging buffers of a group each
    assert every.host == p.pages and every.gpu == fixed + 2 * 1024 * p.page_bytes and every.fits
    auto = place(p, "auto", 140 * gib, 110 * gib)
    layer = p.pages // 28
    assert auto.host % layer == 0 and 0 < auto.host < p.pages and auto.gpu <= 140 * gib < auto.gpu + layer
    # kept attention outputs (1M: 255 chunks x 27 layers x 28.4 MiB): as many layers' as fit beside
    # the pages on the GPU ('auto' leaves less than a layer's room; 'all' most of the GPU), the rest on the host
    kept = plan(cfg, 2**20, kv_grad_dtype=torch.bfloat16, optimizer_bytes_per_param=0, keep_attention=True)
    per_layer = 255 * 4096 * 28 * (128 * 2 + 4)
    assert kept.kept_attention == 27 * per_layer and kept.kept_layers == 27
    assert place(kept, "auto", 140 * gib, 300 * gib).host == auto.host + kept.kept_attention
    assert place(kept, "auto", 140 * gib, 300 * gib).gpu == auto.gpu
    split = place(kept, "all", 140 * gib, 300 * gib)
    n_gpu = (140 * gib - every.gpu) // per_layer
    assert 0 < n_gpu < 27 and split.gpu == every.gpu + n_gpu * per_layer
    assert split.host == every.host + (27 - n_gpu) * per_layer and split.gpu <= 140 * gib
    short = plan(cfg, 2**16, optimizer_bytes_per_param=0, keep_attention=True)
    assert place(short, "none", 140 * gib, 0).gpu == place(plan(cfg, 2**16, optimizer_bytes_per_param=0), "none",
                                                          140 * gib, 0).gpu + short.kept_attention
    # LoRA rank 16 on q, k, v, o and the MLP's gate, up, down of 28 layers: A (in x 16) + B (16 x out) each
    assert lora_params(cfg, 16) == 16 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584) + 3 * (3584 + 18944)) * 28
    assert lora_params(cfg, 16, targets=("q_proj", "k_proj", "v_proj", "o_proj")) == 16 * (
        (3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584)) * 28
    assert parse_bytes("139.8GiB") == int(139.8 * gib) and parse_bytes("80GB") == 80 * 10**9
    with pytest.raises(argparse.ArgumentTypeError, match="'lots' is not a size"):
        parse_bytes("lots")

    def fits(n):
        return place(plan(cfg, n, kv_grad_dtype=torch.bfloat16, optimizer_bytes_per_param=0), "all",
                     140 * gib, 110 * gib).fits
    n = longest_context(fits, 4096)
    assert fits(n) and not fits(n + 4096) and 900_000 < n < 1_100_000  # ~112 KiB of pages a token
    main(["plan", "--seq-len", "1M", "--offload", "all", "--kv-grad-dtype", "bfloat16", "--optimizer", "none",
          "--host-memory", "110GiB"])
    out = capsys.readouterr().out
    assert f"longest context that fits with offload all: {n:,} tokens" in out and "do not fit this machine" in out


def test_plan_prints_one_total_per_length(capsys):
    """`oomb plan` prints, for each length, one table of bytes by kind in two columns (GPU, pinned
    host memory) and one total row, which is place()'s placement of plan() and the sum of the rows
    above it; the headroom is a labelled row; the sparse rows and growth only in a sparse plan; one
    longest-context line."""
    from oomb.config import EngineConfig
    from oomb.plan import place, plan
    from oomb.presets import preset_config

    cfg, gib = preset_config("qwen2.5-7b"), 2**30
    for sparse in ([], ["--sparse-budget", "64"]):
        main(["plan", "--seq-len", "64K", "1M", "--chunk-size", "4096", "--kv-grad-dtype", "bfloat16",
              "--no-checkpoint-layers", "--no-compile", *sparse])
        out = capsys.readouterr().out
        lines = out.splitlines()
        totals = [i for i, line in enumerate(lines) if line.startswith("total ")]
        assert len(totals) == 2 and sum(line.startswith("longest context") for line in lines) == 1, out
        for n, end in zip((2**16, 2**20), totals):
            start = max(i for i, line in enumerate(lines[:end]) if line.split() == ["GPU", "host"])
            rows = [line[len("headroom left free (5 % of the GPU, >= 2 GiB)"):].split("GiB") for line in lines[start + 1 : end]]
            assert lines[end - 1].startswith("headroom left free (5 % of the GPU, >= 2 GiB)  ")
            gpu, host = (float(x) for x in lines[end].split()[1::2])
            assert gpu == pytest.approx(sum(float(r[0]) for r in rows), abs=0.01 * len(rows))
            assert host == pytest.approx(sum(float(r[1] or 0) for r in rows if len(r) > 2), abs=0.01 * len(rows))
            engine = EngineConfig(chunk_size=4096, kv_grad_dtype=torch.bfloat16, checkpoint_layers=False,
                                  sparse=oomb.TopKPages(budget=64) if sparse else None, param_grad_dtype=torch.float32,
                                  keep_attention=False)
            fit = place(plan(cfg, n, engine=engine), "auto", int(139.8 * gib), 110 * gib)
            assert (gpu, host) == (round(fit.gpu / gib, 2), round(fit.host / gib, 2))
        assert ("sparse" in out) == bool(sparse) and ("grows by" in out) == bool(sparse)
        assert "planned" not in out  # the auto line names no second GPU figure


def test_plan_per_rank_under_tensor_parallelism(capsys):
    """`oomb plan --tp N` is one rank's plan: 1/N of every layer's projections (q, k, v, o and the
    MLP's, biases included), KV pages, kept outputs and LoRA's split factors; embeddings and head
    whole. A degree that does not divide the heads, or a mixture of experts, is refused."""
    from oomb.plan import lora_params
    from oomb.plan import count_params, plan
    from oomb.presets import preset_config
    cfg = preset_config("qwen2.5-7b")
    total, split = count_params(cfg, split=True)
    h, kv, inter = 3584, 512, 18944
    assert split == 28 * ((h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter)
    one = plan(cfg, 2**20, optimizer_bytes_per_param=0, keep_attention=True)
    four = plan(cfg, 2**20, optimizer_bytes_per_param=0, keep_attention=True, tp=4)
    assert one.weights == 2 * total and four.weights == four.grads == 2 * (total - split + split // 4)
    assert four.kv_pages == one.kv_pages // 4 and four.grad_pages == one.grad_pages // 4
    assert four.kept_attention == one.kept_attention // 4 and four.page_bytes == one.page_bytes // 4
    assert four.chunk_activations < one.chunk_activations and four.logits_slice == one.logits_slice
    # column-parallel q/k/v/gate/up split their B (out x r), row-parallel o/down their A (r x in)
    assert lora_params(cfg, 16, tp=4) == 28 * 16 * (4 * h + (2 * h + 2 * kv) // 4 + 3 * h + 3 * inter // 4)
    with pytest.raises(ValueError, match="tp=3 must be a degree that divides num_attention_heads=28 and "
                                         "num_key_value_heads=4"):
        plan(cfg, 2**16, tp=3)
    with pytest.raises(ValueError, match=r"tp=2: tensor parallelism is not implemented for GptOssForCausalLM "
                                         r"\(its experts are not split\)"):
        plan(preset_config("gpt-oss-20b"), 2**16, tp=2)
    main(["plan", "--seq-len", "1M", "--tp", "4", "--sparse-budget", "64", "--optimizer", "none"])
    assert "per GPU of TP=4 x DP=1" in capsys.readouterr().out


def test_plan_activations_of_compiled_layers(capsys):
    """Compiled dense layers save the SwiGLU's gate and up but not its product, and no fp32 norm
    intermediates (measured at the 7B shape on an H200: 172 KiB a token and layer); a mixture of
    experts keeps the eager estimate."""
    from oomb.plan import plan
    from oomb.presets import preset_config
    cfg = preset_config("qwen2.5-7b")
    h, inter, qkv = 3584, 18944, (28 + 2 * 4) * 128
    eager, compiled = (plan(cfg, 2**16, chunk_size=8192, compile_layers=c).chunk_activations for c in (False, True))
    assert eager == 8192 * 28 * (2 * (6 * h + 4 * inter + 2 * qkv) + 4 * 2 * h)
    assert compiled == 8192 * 28 * 2 * (6 * h + 3 * inter + 2 * qkv)
    moe = preset_config("gpt-oss-20b")
    assert plan(moe, 2**16, compile_layers=True).chunk_activations == plan(moe, 2**16).chunk_activations
    main(["plan", "--seq-len", "64K", "--chunk-size", "8192", "--compile", "--json"])
    assert json.loads(capsys.readouterr().out)["chunk_activations"] == compiled


def test_plan_counts_what_the_engine_allocates_for_gpt_oss():
    """Parameters counted on the meta device (experts included), and sliding-window layers'
    pages only as the tails the engine stores: the plan's pages equal the engine's pool."""
    from oomb.plan import place, plan
    from tiny_models import make_model
    model = make_model("gpt_oss", layers=4)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16)
    engine.reserve(2, 300)  # 5 chunks: 4 stored
    p = plan(model.config, 300, batch=2, chunk_size=64, page_size=16, dtype=torch.float32)
    assert p.weights == 4 * sum(x.numel() for x in model.parameters())
    assert p.pages == engine.store.pool.n_slots * engine.spec.page_bytes
    assert p.full_layers == 2 and 0 < p.window_pages < p.pages / 2
    gib = 2**30
    every = place(p, "all", 100 * gib, 100 * gib)
    assert every.host == p.pages - p.window_pages  # full layers' pages go to the host, windows' stay


def test_token_files_are_checked_before_training(tmp_path):
    """.npy carries its dtype; a .bin's must be right; ids beyond the vocabulary, a torn file
    or too few tokens are refused up front with the fix in the message."""
    import numpy as np

    from oomb.train.data import make_data
    ids = np.arange(300, dtype=np.uint32) % 250
    np.save(tmp_path / "ok.npy", ids)
    batch, _ = next(make_data(str(tmp_path / "ok.npy"), 256, 64, 2))
    assert batch.shape == (2, 64) and batch.dtype == torch.int64
    assert torch.equal(batch[0, 1:] - batch[0, :-1] == 1, (batch[0, :-1] != 249))  # consecutive windows
    big = np.array([1, 2, 70_000] * 50, dtype=np.uint32)
    big.tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="token id 4,464 >= the model's vocab_size=256: .* use --data-dtype uint32"):
        make_data(str(tmp_path / "big.bin"), 256, 64, 1)  # read as uint16: 70,000 splits into garbage ids
    with pytest.raises(ValueError, match="token id 70,000 >= the model's vocab_size=65,536"):
        make_data(str(tmp_path / "big.bin"), 65_536, 64, 1, dtype="uint32")
    (tmp_path / "torn.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a whole number of uint16 token ids"):
        make_data(str(tmp_path / "torn.bin"), 256, 1, 1)
    with pytest.raises(ValueError, match="holds 300 tokens, fewer than seq_len=4,096"):
        make_data(str(tmp_path / "ok.npy"), 256, 4096, 1)
    np.save(tmp_path / "two_d.npy", np.zeros((2, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="2-D int32 array"):
        make_data(str(tmp_path / "two_d.npy"), 256, 1, 1)


def test_tokenize_then_train(tmp_path, capsys):
    """oomb tokenize: .jsonl and .txt documents through a checkpoint's tokenizer, joined by EOS,
    into a .npy that oomb train reads."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>").save_pretrained(tmp_path / "ckpt")
    (tmp_path / "a.jsonl").write_text('{"text": "the cat sat"}\n\n{"text": "a dog"}\n')
    (tmp_path / "b.txt").write_text("the mat " * 40)
    out = tmp_path / "tokens.npy"
    main(["tokenize", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--model", str(tmp_path / "ckpt"),
          "--output", str(out)])
    tokens = np.load(out)
    assert "wrote 88 tokens" in capsys.readouterr().out and tokens.dtype == np.uint16
    # 3 + EOS, 2 + EOS (the blank line is skipped), 80 + EOS
    assert tokens[:7].tolist() == [2, 3, 4, 0, 7, 8, 0] and tokens[-1] == 0 and len(tokens) == 88
    losses = train(TrainConfig(data=str(out), seq_len=64, chunk_size=32, page_size=16, steps=2, log_every=10))
    assert len(losses) == 2 and "copy task" not in capsys.readouterr().out  # the copy task's summary only
    with pytest.raises(SystemExit, match="has no 'body' field; set --text-field"):
        main(["tokenize", str(tmp_path / "a.jsonl"), "--model", str(tmp_path / "ckpt"), "--output", str(out),
              "--text-field", "body"])
    with pytest.raises(SystemExit, match="no tokenizer for --model 'tiny'"):
        main(["tokenize", str(tmp_path / "b.txt"), "--model", "tiny", "--output", str(out)])


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_final_export_loads_with_transformers_and_peft(tmp_path, lora_rank):
    """<output_dir>/final: the whole model (AutoModelForCausalLM) or the adapter (PeftModel on
    the base) holding the trained weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from oomb.presets import load_model
    cfg = TrainConfig(**SMALL, output_dir=str(tmp_path), lora_rank=lora_rank)
    train(cfg)
    # the trainable tensors of step 3, named as PEFT and transformers name them
    trained = load_file(tmp_path / "step-000003" / f"{'adapter_' if lora_rank else ''}model.safetensors")
    if lora_rank:
        import peft
        torch.manual_seed(cfg.seed)  # the trainer's base: the preset's seeded random weights
        base = load_model("tiny")
        model = peft.PeftModel.from_pretrained(base, tmp_path / "final")
        params = peft.get_peft_model_state_dict(model)
    else:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
        params = dict(model.named_parameters())
    assert trained and all(torch.equal(params[n].detach(), t) for n, t in trained.items())


def test_plan_counts_the_sparse_representatives_and_selections():
    """The plan's sparse bytes equal what the engine keeps: representatives of every stored
    page of the full layers, and each chunk's selection (a partial last chunk included)."""
    from oomb.plan import plan
    from tiny_models import make_model
    model = make_model("gpt_oss", layers=4)  # 2 sliding-window layers (dense, no representatives), 2 full
    sparse = oomb.TopKPages(budget=2, block_queries=16, chunk_budget=3)
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=64, page_size=16, backend="torch", sparse=sparse)
    engine.forward_backward(torch.randint(0, 97, (2, 300)))  # 5 chunks, the last 44 tokens
    p = plan(model.config, 300, batch=2, chunk_size=64, page_size=16, dtype=torch.float32, sparse=sparse)
    assert p.representatives == engine.store.reps.numel() * engine.store.reps.element_size() > 0
    kept = sum(t.numel() * t.element_size() for sel in engine._selection.values() for t in (sel.pages, sel.blocks))
    assert p.selections == kept > 0 and {i for _, i in engine._selection} == {1, 3}  # the full layers


def test_gradient_accumulation_equals_one_big_batch(monkeypatch, tmp_path, capsys):
    """2 micro-batches of 1 sequence per step train exactly as 1 batch of 2 (same data): same
    losses over two steps (the second one after an optimizer update) and gradient norms."""
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (4, 256))

    def fixed_data(source, vocab, seq_len, batch, seed=0, **_):
        for i in range(0, len(tokens), batch):
            yield tokens[i : i + batch], tokens[i : i + batch]

    monkeypatch.setattr("oomb.train.trainer.make_data", fixed_data)
    cfg = {**SMALL, "steps": 2, "lr": 1e-2}
    big = train(TrainConfig(**cfg, batch=2))
    norms_big = [line.split("grad_norm ")[1].split()[0] for line in capsys.readouterr().out.splitlines()
                 if "grad_norm" in line]
    accumulated = train(TrainConfig(**cfg, batch=1, grad_accum=2, output_dir=str(tmp_path)))
    out = capsys.readouterr().out
    norms_acc = [line.split("grad_norm ")[1].split()[0] for line in out.splitlines() if "grad_norm" in line]
    assert "2 micro-batches of 1 x 256 tokens a step" in out
    assert accumulated == pytest.approx(big, rel=1e-5) and len(norms_big) == 2 and norms_acc == norms_big
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["tokens"] == 512
    assert rows[1]["loss"] == pytest.approx(accumulated[1])
    with pytest.raises(ValueError, match="grad_accum=0 must be >= 1"):
        TrainConfig(grad_accum=0)


def test_group_pages_reaches_the_engine(monkeypatch):
    """--group-pages (pages per attention call) is the engine's; one call or a call per page (the
    second chunk reads two pages) train alike: grouping changes only the order of the sums."""
    from oomb.train import trainer

    made, engine = [], trainer.ChunkRecurrentEngine
    monkeypatch.setattr(trainer, "ChunkRecurrentEngine",
                        lambda model, config: made.append(config.group_pages) or engine(model, config))
    one_call = train(TrainConfig(**{**SMALL, "steps": 2}, group_pages=64))
    per_page = train(TrainConfig(**{**SMALL, "steps": 2}, group_pages=1))
    assert made == [64, 1] and per_page == pytest.approx(one_call, rel=1e-5)
    with pytest.raises(ValueError, match="group_pages=0 must be >= 1"):
        TrainConfig(group_pages=0)


def test_periodic_evaluation_is_the_models_held_out_loss(tmp_path, capsys):
    """--eval-every: the held-out loss logged after the last step is transformers' loss of the
    exported model on the same held-out batches; it is evaluated at every multiple and the end."""
    from transformers import AutoModelForCausalLM

    from oomb.train.trainer import heldout_batches

    cfg = TrainConfig(**{**SMALL, "steps": 3}, eval_every=2, eval_batches=2, output_dir=str(tmp_path))
    train(cfg)
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("eval")] == ["2/3", "3/3"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3] and evals[-1]["eval_tokens"] == 2 * 255
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [float(model(input_ids=ids, labels=labels).loss) for ids, labels in heldout_batches(cfg, 256, 0)]
    assert evals[-1]["eval_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    with pytest.raises(ValueError, match="eval_batches=0 must be >= 1"):
        TrainConfig(eval_batches=0)


def test_compiled_layers_train_like_eager():
    """--compile (torch.compile around attention) with LoRA adapters: the same losses."""
    cfg = {**SMALL, "steps": 2, "lora_rank": 4}
    eager = train(TrainConfig(**cfg))
    assert train(TrainConfig(**cfg, compile=True)) == pytest.approx(eager, rel=1e-5)


def test_compile_defaults_on_under_tensor_parallelism():
    """--compile/--no-compile, default: on with --tp > 1 only (eager DTensor dispatch leaves the GPU
    waiting on the host: TP=2 at 256K took 52.9 s eager, 29.1 s compiled, 42.5 s on one GPU)."""
    from oomb.flags import add_settings

    parser = argparse.ArgumentParser()
    add_settings(parser)
    assert [parser.parse_args(a).compile for a in ([], ["--compile"], ["--no-compile"])] == [None, True, False]
    assert not TrainConfig().compile_layers and TrainConfig(compile=True).compile_layers
    assert TrainConfig(tp=2).compile_layers and not TrainConfig(tp=2, compile=False).compile_layers


def test_bf16_updates_below_half_a_step_are_lost_with_adamw_and_kept_by_adamw8bit():
    """torch's AdamW on bf16 weights rounds an update of lr back wherever |w| >= 512 lr (the
    trainer warns with that share); torchao's AdamW8bit rounds stochastically, so such weights
    move (each with probability ~ update / step), and its state takes ~2 B per value."""
    from oomb.train.trainer import lost_update_fraction, make_optimizer, optimizer_state_bytes

    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(1024, 256) * 0.02).bfloat16())
    big = w.detach().abs() >= 512 * 1e-5
    assert lost_update_fraction([w], 1e-5) == pytest.approx(big.float().mean().item())
    assert 0.75 < lost_update_fraction([w], 1e-5) < 0.85  # N(0, 0.02): P(|w| >= 5.1e-3) = 0.80
    moved = {}
    for name in ("adamw", "adamw8bit"):
        p = torch.nn.Parameter(w.detach().clone())
        opt = make_optimizer([p], TrainConfig(optimizer=name, lr=1e-5))
        predicted = optimizer_state_bytes(opt)  # before the state exists: what 'auto' reserves
        for _ in range(4):
            p.grad = torch.ones_like(p)  # Adam's update: -lr each step
            opt.step()
        moved[name] = (p.detach() != w.detach())[big].float().mean().item()
        moments = [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq")]
        parts = [t for m in moments for t in ((m.codes, m.scale, m.qmap) if name == "adamw8bit" else (m,))]
        assert predicted == sum(t.numel() * t.element_size() for t in parts)
        assert predicted <= {"adamw": 4, "adamw8bit": 2.1}[name] * p.numel()
    assert moved["adamw"] == 0.0 and moved["adamw8bit"] > 0.02, moved


def test_adamw8bit_trains_bf16_and_resumes_exactly(tmp_path, capsys):
    cfg = {**SMALL, "dtype": "bfloat16", "lr": 1e-4}
    train(TrainConfig(**{**cfg, "steps": 1}))
    assert "% of the trainable weights (|w| >= 0.051) cannot change" in capsys.readouterr().out
    full = train(TrainConfig(**cfg, optimizer="adamw8bit", output_dir=str(tmp_path), save_every=2))
    assert "cannot change" not in capsys.readouterr().out and all(map(math.isfinite, full))
    resumed = train(TrainConfig(**cfg, optimizer="adamw8bit", resume=str(tmp_path / "step-000002")))
    assert resumed == [full[-1]]


def test_trainer_sums_parameter_gradients_in_fp32_by_default(monkeypatch):
    """The trainer's engine sums chunk gradients in fp32 (bf16 sums drift ~1e-2 at 64 chunks:
    test_engine), unless --param-grad-dtype param; oomb plan counts those sums."""
    import oomb.train.trainer as trainer
    from oomb.plan import plan
    from oomb.presets import preset_config

    made = []
    real = trainer.ChunkRecurrentEngine
    monkeypatch.setattr(trainer, "ChunkRecurrentEngine",
                        lambda model, config: made.append(config) or real(model, config))
    for choice, want in (("float32", torch.float32), ("param", None)):
        train(TrainConfig(**{**SMALL, "steps": 1}, param_grad_dtype=choice))
        assert made[-1].param_grad_dtype == want
    cfg = preset_config("qwen2.5-7b")
    bf16_sums, fp32_sums = (plan(cfg, 2**16, param_grad_dtype=d).grads for d in (None, torch.float32))
    assert fp32_sums == 2 * bf16_sums
    with pytest.raises(ValueError, match="param_grad_dtype='fp16' must be one of float32, param"):
        TrainConfig(param_grad_dtype="fp16")


def test_keep_attention_trains_identically(capsys):
    """--keep-attention (stage 2 takes stage 1's attention outputs): the same losses, bitwise; by
    default the engine keeps them when they fit (they do here), and the start-up line says so."""
    cfg = {**SMALL, "steps": 2}
    assert train(TrainConfig(**cfg, keep_attention=True)) == train(TrainConfig(**cfg, keep_attention=False))
    capsys.readouterr()
    train(TrainConfig(**{**cfg, "steps": 1}))
    assert "kept attention (1 of 1 layers, host)" in capsys.readouterr().out  # a CPU model's go to its arena
    train(TrainConfig(**{**cfg, "steps": 1, "kept_host_gib": 0.0}))
    assert "kept attention" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="kept_host_gib=-1.0 must be >= 0"):
        TrainConfig(kept_host_gib=-1.0)


def test_loss_last_needles_rope_and_heldout_windows(tmp_path, monkeypatch):
    """--loss-last: the engine sees labels only on each sequence's last tokens; --needle-rate: some
    sequences carry needles; --rope-theta reaches the model and its export; --eval-data: the held-out
    batches are the file's first windows."""
    import numpy as np

    from oomb.engine import ChunkRecurrentEngine
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
    np.save(tmp_path / "t.npy", tokens)
    seen = []
    evaluate, forward_backward = ChunkRecurrentEngine.evaluate, ChunkRecurrentEngine.forward_backward

    def fb(self, ids, labels, **kw):
        seen.append(("train", ids.clone(), labels.clone()))
        return forward_backward(self, ids, labels, **kw)

    def ev(self, ids, labels=None, **kw):
        seen.append(("eval", ids.clone(), labels))
        return evaluate(self, ids, labels, **kw)
    monkeypatch.setattr(ChunkRecurrentEngine, "forward_backward", fb)
    monkeypatch.setattr(ChunkRecurrentEngine, "evaluate", ev)
    cfg = TrainConfig(**{**SMALL, "seq_len": 512, "chunk_size": 128}, data=str(tmp_path / "t.npy"),
                      eval_data=str(tmp_path / "t.npy"), eval_every=3, eval_batches=2, loss_last=100,
                      needle_rate=1.0, needles_per_sequence=2, tokenizer="bytes", rope_theta=50_000.0,
                      output_dir=str(tmp_path / "run"))
    train(cfg)
    for kind, ids, labels in seen:
        if kind == "train":
            assert (labels[:, :-100] == -100).all() and torch.equal(labels[:, -100:], ids[:, -100:])
            assert b"The value of key" in bytes(ids[0].numpy().astype(np.uint8))  # every sequence a carrier
    evals = [ids for kind, ids, _ in seen if kind == "eval"]
    assert len(evals) == 2 and torch.equal(evals[0][0], torch.from_numpy(tokens[:512].astype(np.int64)))
    assert torch.equal(evals[1][0], torch.from_numpy(tokens[512:1024].astype(np.int64)))
    config = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 50_000.0
    with pytest.raises(ValueError, match="loss_last=512 must be >= 0 and < seq_len=512"):
        TrainConfig(seq_len=512, loss_last=512)
    with pytest.raises(ValueError, match="holds 9 windows of seq_len=512; 10 are needed"):
        train(TrainConfig(**{**SMALL, "seq_len": 512}, eval_data=str(tmp_path / "t.npy"), eval_every=1,
                          eval_batches=10))


def test_a_cuda_device_gets_its_index(monkeypatch):
    """--device auto or cuda name the current CUDA device with its index: torch's per-process
    memory fraction, which the plan reads, refuses a device without one."""
    from oomb.train.trainer import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available here; use --device cpu"):
        resolve_device("cuda")


def test_lr_schedules():
    """Warm-up, then cosine to 10 % of the peak by the last step, or the peak throughout."""
    from oomb.train.trainer import lr_lambda

    cosine = lr_lambda(TrainConfig(steps=10, warmup_steps=2))
    assert [round(cosine(s), 6) for s in (0, 1, 2, 6, 10)] == [round(1 / 3, 6), round(2 / 3, 6), 1.0, 0.55, 0.1]
    constant = lr_lambda(TrainConfig(steps=10, warmup_steps=2, lr_schedule="constant"))
    assert [constant(s) for s in range(2, 11)] == [1.0] * 9 and constant(0) == cosine(0)
    with pytest.raises(ValueError, match="lr_schedule='linear' must be one of cosine, constant"):
        TrainConfig(lr_schedule="linear")


def test_plan_builds_the_sparse_policy_oomb_train_builds(capsys):
    """`oomb plan` takes every sparse_* setting of oomb train and builds the same policy
    (attention.policy.build_policy): min-max representatives are twice the mean's bytes, a larger chunk
    budget stages more pages, each as plan() gives for that TopKPages."""
    from oomb.cli import main
    from oomb.plan import plan
    from oomb.presets import preset_config

    def planned(*flags):
        main(["plan", "--model", "qwen2.5-7b", "--seq-len", "256K", "--chunk-size", "4096", "--sparse-budget", "64",
              "--json", *flags])
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    mean, minmax = planned(), planned("--sparse-representative", "minmax")
    assert minmax["representatives"] == 2 * mean["representatives"] > 0
    wide = planned("--sparse-chunk-budget", "512", "--sparse-sink-pages", "2", "--sparse-dense-layers", "-1")
    sparse = oomb.TopKPages(budget=64, chunk_budget=512, sink_pages=2, dense_layers=(-1,))
    assert wide["staged_pages"] == plan(preset_config("qwen2.5-7b"), 2**18, sparse=sparse,
                                        chunk_size=4096).staged_pages != mean["staged_pages"]
