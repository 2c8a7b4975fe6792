"""Data and tensor parallelism on CPU (gloo, 2 processes) give one process's loss and gradients."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oomb
from oomb.parallel import (all_reduce_gradients, apply_tensor_parallel, global_token_count, init_distributed,
                           local_tensor)
from oomb.plan import GPU_MARGIN_BYTES, plan
from tiny_models import VOCAB, make_model, rel_err

TOL = 1e-5


def _batch():
    ids = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, :40] = -100  # the two sequences predict different numbers of tokens
    return ids, labels


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank, world, port, mode, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    mesh = init_distributed(tp=world if mode.startswith("tp") else 1)
    model = _model(mode)
    ids, labels = _batch()
    if mode.startswith("tp"):
        apply_tensor_parallel(model, mesh["tp"])
    else:  # dp: each rank its own sequence, normalised by the global count
        ids, labels = ids[rank : rank + 1], labels[rank : rank + 1]
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch",
                                       compile_layers=mode == "tp_compile")
    engine.memory.free_gpu_bytes = lambda: 2**40  # what 'auto' would see free on a GPU
    headroom = engine.memory.headroom(engine.config)  # before the step: every parameter's gradient is still to come
    count = global_token_count(labels, mesh["dp"].get_group())
    result = engine.forward_backward(ids, labels, num_tokens=count)
    loss = result.loss.clone()
    if mode == "dp":
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        all_reduce_gradients(model, mesh["dp"].get_group())
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        local_params = sum(local_tensor(p).numel() for p in model.parameters())
        torch.save({"loss": loss, "grads": grads, "kv_heads": engine.spec.n_kv_heads, "local_params": local_params,
                    "headroom": headroom}, out)
    dist.barrier()
    dist.destroy_process_group()


def _model(mode):
    model = make_model("qwen3" if mode == "tp_qwen3" else "qwen2_tp")
    if mode == "tp_lora":  # adapters on every projection, non-zero B so that every path carries gradient
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return model


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["dp", "tp", "tp_lora", "tp_compile", "tp_qwen3"])
def test_two_processes_equal_one(mode, tmp_path):
    """tp_compile: the layers through torch.compile, which traces DTensor's collectives; tp_qwen3:
    q/k norms, whose weights serve every head while each rank computes its own heads."""
    model = _model(mode)
    ids, labels = _batch()
    ref = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch").forward_backward(ids, labels)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(2, _free_port(), mode, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    if mode.startswith("tp"):
        assert got["kv_heads"] == 1  # each rank keeps the pages of its own KV head only
    if mode in ("tp", "tp_compile"):  # `oomb plan --tp 2` counts the rank's weights exactly
        local = plan(model.config, 32, chunk_size=32, page_size=16, dtype=torch.float32, tp=2,
                     compile_layers=mode == "tp_compile")
        assert local.weights == 4 * got["local_params"]
        # 'auto' leaves room for the rank's own gradients and working set, not the whole model's
        assert got["headroom"] == 2**40 - local.working_set - local.grads - GPU_MARGIN_BYTES
    assert rel_err(got["loss"], ref.loss) <= TOL
    for n, g in ref_grads.items():
        assert rel_err(got["grads"][n], g) <= TOL, n


def test_tp_degree_must_divide_heads():
    class Mesh:
        def size(self):
            return 3
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the tensor-parallel degree 3"):
        apply_tensor_parallel(make_model("qwen2_tp"), Mesh())


def test_tp_refuses_moe_layers_clearly():
    class Mesh:
        def size(self):
            return 2
    with pytest.raises(ValueError, match=r"not implemented for GptOssForCausalLM \(its experts are not split\)"):
        apply_tensor_parallel(make_model("gpt_oss"), Mesh())


def test_torchrun_tensor_parallel_training_resumes_exactly(tmp_path):
    """`torchrun -m oomb.cli train --tp 2` end to end: rank-0 logs, per-rank optimizer state,
    and a resumed run reproduces the uninterrupted run's last loss. Layers are compiled by
    default under --tp (DTensor's eager per-op dispatch bounds a TP step by the host)."""
    import re
    import subprocess
    import sys

    def run(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "oomb.cli", "train", "--tp", "2", "--seq-len", "256", "--chunk-size", "128",
               "--page-size", "64", "--steps", "3", "--backend", "torch", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        assert "compiled layers" in out.stdout
        return {int(m[0]): float(m[1]) for m in re.findall(r"step\s+(\d+)/3\s+loss ([\d.]+)", out.stdout)}

    full = run("--output-dir", str(tmp_path), "--save-every", "2")
    assert sorted(full) == [1, 2, 3]  # one log line a step: rank 0 only
    ckpt = tmp_path / "step-000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "manifest.json", "model.safetensors",
                                                       "optimizer-rank0.pt", "optimizer-rank1.pt", "rng-rank0.pt",
                                                       "rng-rank1.pt", "trainer.json"]
    # The export gathers the shards: transformers loads the whole trained model.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final").named_parameters())
    trained = load_file(tmp_path / "step-000003" / "model.safetensors")
    assert trained.keys() == exported.keys() and all(torch.equal(exported[n].detach(), t) for n, t in trained.items())
    resumed = run("--resume", str(ckpt))
    assert sorted(resumed) == [3] and resumed[3] == full[3]


def test_torchrun_data_parallel_with_sharded_optimizer_state(tmp_path):
    """`torchrun -m oomb.cli train` on 2 data-parallel ranks: ZeRO-1 (each rank keeps AdamW's
    state of its share of the parameters) trains exactly as replicated AdamW; each rank
    checkpoints its share, and a resumed run reproduces steps 3 and 4 (4: after an update with
    the restored state and learning rate)."""
    import re
    import subprocess
    import sys

    from oomb.presets import load_model

    def run(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "oomb.cli", "train", "--seq-len", "256", "--chunk-size", "128",
               "--page-size", "64", "--steps", "4", "--backend", "torch", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout, {int(m[0]): float(m[1]) for m in re.findall(r"step\s+(\d+)/4\s+loss ([\d.]+)", out.stdout)}

    log, sharded = run("--output-dir", str(tmp_path), "--save-every", "2")
    assert "2 data-parallel x 1 tensor-parallel ranks (optimizer state sharded: ZeRO-1)" in log
    _, replicated = run("--no-shard-optimizer")
    assert sorted(sharded) == [1, 2, 3, 4] and sharded == replicated
    shares = [torch.load(tmp_path / "step-000002" / f"optimizer-rank{r}.pt", weights_only=True) for r in (0, 1)]
    counts = [len(share["optimizer"]["state"]) for share in shares]
    assert all(share["ranks"] == 2 for share in shares) and min(counts) > 0
    assert sum(counts) == len(list(load_model("tiny").parameters()))  # each parameter's state on one rank
    _, resumed = run("--resume", str(tmp_path / "step-000002"))
    assert sorted(resumed) == [3, 4] and resumed == {3: sharded[3], 4: sharded[4]}
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import train
    with pytest.raises(ValueError, match=r"another run configuration \(processes: 2 there, 1 here\)"):
        train(TrainConfig(seq_len=256, chunk_size=128, page_size=64, steps=4, backend="torch", device="cpu",
                          resume=str(tmp_path / "step-000002")))  # one process


def _state_bytes_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import make_optimizer, optimizer_state_bytes
    mesh = init_distributed(tp=1)
    params = list(make_model("qwen2_tp").parameters())
    share = optimizer_state_bytes(make_optimizer(params, TrainConfig(), mesh["dp"].get_group()))
    shares = [None] * world
    dist.all_gather_object(shares, share)
    if rank == 0:
        torch.save({"shares": shares, "whole": optimizer_state_bytes(make_optimizer(params, TrainConfig()))}, out)
    dist.destroy_process_group()


def test_optimizer_state_counts_this_ranks_share(tmp_path):
    """What 'auto' leaves free for AdamW's state: the whole of it, or under ZeRO-1 this rank's
    partition (uneven: counted, not divided), the ranks' shares adding up to the whole."""
    out = tmp_path / "shares.pt"
    mp.spawn(_state_bytes_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    whole = 2 * 4 * sum(p.numel() for p in make_model("qwen2_tp").parameters())  # two fp32 moments
    assert got["whole"] == whole and sum(got["shares"]) == whole and 0 < min(got["shares"]) < whole

