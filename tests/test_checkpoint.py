"""Checkpoints a user can trust: nothing in them runs as code."""
import json
import os
from pathlib import Path

import pytest
import torch

from oomb.train import checkpoint
from oomb.train.config import TrainConfig
from oomb.train.trainer import train

SMALL = dict(seq_len=256, chunk_size=128, page_size=64, steps=4, backend="torch", device="cpu")


def test_a_payload_planted_in_a_checkpoint_is_refused_and_never_runs(tmp_path):
    """A pickled object whose unpickling runs code (here: exec writing a marker file), added to an
    optimizer or RNG file whose manifest entry is then re-hashed, is refused with a message
    naming the file and the call; the code never runs."""
    train(TrainConfig(**{**SMALL, "steps": 2}, output_dir=str(tmp_path / "run"), save_every=2))
    ckpt = tmp_path / "run" / "step-000002"
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    for name in ("optimizer.pt", "rng-rank0.pt"):
        whole = (ckpt / name).read_bytes()
        content = torch.load(ckpt / name, weights_only=True)
        torch.save({**content, "extra": Payload()}, ckpt / name)
        checkpoint._write_manifest(ckpt)  # the manifest proves the files are intact, not who wrote them
        checkpoint.verify(ckpt)
        with pytest.raises(ValueError, match=rf"{name} holds a call to exec; oomb loads only tensors from a "
                                             "checkpoint and runs no code from one"):
            train(TrainConfig(**SMALL, resume=str(ckpt)))
        assert not marker.exists()
        (ckpt / name).write_bytes(whole)
        checkpoint._write_manifest(ckpt)
    torch.save({"extra": Payload()}, tmp_path / "payload.pt")
    torch.load(tmp_path / "payload.pt", weights_only=False)  # the payload is live: unpickled, it runs
    assert marker.read_text() == "ran"


def test_tensor_parallel_optimizer_state_is_plain_tensors_and_placements(tmp_path):
    """DTensor optimizer state (tensor parallelism) is saved as each rank's local tensors with
    their placements in JSON, read with weights_only=True and rebuilt as DTensors equal to the
    saved ones (one gloo process here; tests/test_parallel.py resumes a 2-rank --tp run)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def make():
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 6)
            for name, p in list(model.named_parameters()):
                setattr(model, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
            optimizer = torch.optim.AdamW(model.parameters())
            return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

        model, optimizer, scheduler = make()
        for p in model.parameters():
            p.grad = distribute_tensor(torch.randn(p.shape), mesh, [Shard(0)])
        optimizer.step()
        path = checkpoint.save(tmp_path, 1, model, optimizer, scheduler, TrainConfig())
        saved = torch.load(path / "optimizer-rank0.pt", weights_only=True)
        assert not any(isinstance(v, DTensor) for entry in saved["optimizer"]["state"].values() for v in entry.values())
        assert json.loads(saved["dtensors"])["0/exp_avg"] == {"placements": [["shard", 0]], "shape": [6, 4],
                                                               "stride": [4, 1]}
        model2, optimizer2, scheduler2 = make()
        assert checkpoint.load(path, model2, optimizer2, scheduler2) == 1
        for p, p2 in zip(model.parameters(), model2.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = optimizer2.state[p2][key], optimizer.state[p][key]
                assert isinstance(got, DTensor) and got.placements == want.placements
                assert torch.equal(got.full_tensor(), want.full_tensor())
    finally:
        dist.destroy_process_group()
