"""The README's engine loop ("The library API") runs as written, on a tiny model on the CPU: the
block is taken from README.md, and only what names a 7B model, a GPU, a 4096-token chunk and a
1M-token reservation is swapped for tiny CPU counterparts (a chunk of 4096 takes the CPU's
reference attention half a minute); the loss it prints is transformers' own."""
import contextlib
import io
import os
import re

import pytest
import torch

from tiny_models import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN, CHUNK = 1024, 512  # two chunks of 4 pages of 128: all within the README's top-64 budget


def engine_loop() -> str:
    """The python block of README.md's "The library API" section."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("\n## The library API\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"^```python\n(.*?)^```", section, flags=re.M | re.S).group(1)


def test_readme_engine_loop_runs_as_written(tmp_path):
    checkpoint = tmp_path / "tiny-qwen2"
    make_model("qwen2").save_pretrained(checkpoint)
    code = engine_loop()
    swaps = {'"Qwen/Qwen2.5-7B"': repr(str(checkpoint)), ".cuda()": "", "chunk_size=4096": f"chunk_size={CHUNK}",
             "seq_len=1_048_576": f"seq_len={SEQ_LEN}"}
    for old, new in swaps.items():
        assert code.count(old) == 1, f"README.md's engine loop no longer has {old}: update this test"
        code = code.replace(old, new)
    torch.manual_seed(0)
    batches = []
    for _ in range(2):
        input_ids = torch.randint(0, 97, (1, SEQ_LEN))
        labels = input_ids.clone()
        labels[:, :100] = -100
        batches.append((input_ids, labels))
    out = io.StringIO()
    namespace = {"batches": batches}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    printed = [line.split() for line in out.getvalue().splitlines()]
    assert len(printed) == 2
    # the first loss is the untrained model's: transformers' loss of the same checkpoint in the same dtype
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(input_ids=batches[0][0], labels=batches[0][1]).loss.float()
    # (measured: 3e-6 apart; another batch's loss is 2e-3 away: random tokens all score about log(97))
    assert float(printed[0][0]) == pytest.approx(float(expected), rel=1e-4)
    assert int(printed[0][1]) == int((batches[0][1][:, 1:] != -100).sum())
    # the optimizer stepped: the README's model is no longer the checkpoint's
    model = namespace["model"]
    assert any(not torch.equal(p, reference.state_dict()[n]) for n, p in model.state_dict().items())
