"""fp32 gradient sums over chunks (oomb/grad_sums.py) against adding every gradient into an fp32
buffer and rounding once: bitwise, through the engine, for tied embeddings, a mixture of experts,
recomputed layers, one, two and several chunks and a .grad already there. The one-pass add kernel
against torch (CPU: TRITON_INTERPRET=1 in float16/float32; GPU: -m gpu in bfloat16)."""
import contextlib

import pytest
import torch

import oomb
import oomb.engine
from oomb import grad_sums
from tiny_models import VOCAB, make_model


class AddEveryGradient:
    """The reference: each chunk's gradient added into an fp32 buffer as it comes, rounded at close()."""

    def __init__(self, params, wide):
        self.params, self.wide, self.sums = params, wide, {}
        for p in params:
            if p.grad is not None:
                self.sums[p], p.grad = p.grad.to(wide), None
        self.hooks = [p.register_post_accumulate_grad_hook(self._move) for p in params]

    def finishing(self):
        return contextlib.nullcontext()

    def _move(self, p):
        grad, p.grad = p.grad, None
        if p in self.sums:
            self.sums[p].add_(grad)
        else:
            self.sums[p] = grad.to(self.wide)

    def close(self):
        for h in self.hooks:
            h.remove()
        for p in self.params:
            if p in self.sums:
                p.grad = self.sums.pop(p).to(p.dtype)


class Watched(grad_sums.GradSums):
    """GradSums, counting the parameters rounded in the last backward and those held unsummed."""

    seen: list

    def close(self):
        Watched.seen.append((len(self.done), len(self.first), len(self.sums)))
        super().close()


def grads_with(monkeypatch, sums_class, model, ids, micro_batches=1, device="cpu", **kwargs):
    monkeypatch.setattr(oomb.engine, "GradSums", sums_class)
    model.zero_grad(set_to_none=True)
    engine = oomb.ChunkRecurrentEngine(model, param_grad_dtype=torch.float32, **kwargs)
    for m in range(micro_batches):
        engine.forward_backward(ids.roll(m, dims=1))
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family,seq_len,kwargs,micro_batches", [
    ("llama", 256, {}, 1),  # tied embeddings: the head's gradient, then the embedding's in the last backward
    ("qwen2", 256, {"checkpoint_layers": True}, 1),
    ("gpt_oss", 200, {}, 1),  # experts, sinks; a partial last chunk
    ("qwen2", 128, {}, 1),  # two chunks: first + last in one pass
    ("qwen2", 50, {}, 1),  # one chunk: each gradient is its own sum
    ("llama", 256, {}, 2),  # a second micro-batch starts from the first's .grad
])
def test_sums_equal_adding_every_gradient_bitwise(monkeypatch, family, seq_len, kwargs, micro_batches):
    model = make_model(family, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(2))
    args = dict(chunk_size=64, page_size=16, backend="torch", **kwargs)
    want = grads_with(monkeypatch, AddEveryGradient, model, ids, micro_batches, **args)
    Watched.seen = []
    got = grads_with(monkeypatch, Watched, model, ids, micro_batches, **args)
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, differ
    assert all(g.dtype == torch.bfloat16 for g in got.values())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    # The last backward call (through the layers and the embedding) rounds its parameters' sums;
    # the final norm and an untied head got their last gradient in the head's own backward.
    done, first, summed = Watched.seen[-1]
    n_params = len(want)
    head = 1 if model.config.tie_word_embeddings else 2  # final norm (+ lm_head when untied)
    assert done == n_params - head, Watched.seen
    chunks = -(-seq_len // 64)
    assert first == (head if chunks == 1 and micro_batches == 1 else 0)
    assert summed == (0 if chunks == 1 and micro_batches == 1 else head)


def test_a_second_gradient_in_the_last_backward_is_an_error():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    sums = grad_sums.GradSums([p], torch.float32)
    with sums.finishing():
        (p * 2).sum().backward()
        with pytest.raises(RuntimeError, match=r"shape \(3,\) received a second gradient"):
            (p * 3).sum().backward()
    sums.close()


@pytest.mark.parametrize("n", [1, 17, 4097, 10_000])
@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype", [
    (torch.float16, torch.float16, torch.float32),  # a first and a second gradient: the sum starts
    (torch.float16, torch.float16, torch.float16),  # two chunks: first + last, rounded
    (torch.float32, torch.float16, torch.float16),  # a sum + the last gradient, rounded
    (torch.float32, torch.float16, torch.float32),  # a sum + a middle gradient
])
def test_one_pass_add_kernel_equals_torch(n, a_dtype, b_dtype, out_dtype):
    """The kernel through Triton's interpreter on CPU (float16: the interpreter's bfloat16 is raw
    bits); its adds are torch's exactly."""
    launch = grad_sums._triton_sum()
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 3).to(a_dtype)
    b = (torch.randn(n, generator=g) * 1e-3).to(b_dtype)
    want = (a.float() + b.float()).to(out_dtype)
    out = torch.empty(n, dtype=out_dtype)
    launch(a, b, out)
    assert torch.equal(out, want)
    for which in (0, 1):  # written over an input of out's dtype: a middle gradient's add, the last one's
        inputs = [a, b]
        if inputs[which].dtype == out_dtype:
            inputs[which] = into = inputs[which].clone()
            launch(*inputs, into)
            assert torch.equal(into, want), which


def test_adds_off_cuda_are_torchs():
    a, b, total = torch.randn(5).bfloat16(), torch.randn(5).bfloat16(), torch.randn(5)
    assert torch.equal(grad_sums.pair_sum(a, b, torch.float32), a.float() + b.float())
    assert torch.equal(grad_sums.pair_sum(a, b, torch.bfloat16), (a.float() + b.float()).bfloat16())
    assert torch.equal(grad_sums.pair_sum(a, b, torch.float64, torch.float64), a.double() + b.double())
    want = total + b.float()
    assert torch.equal(grad_sums.add_into(total.clone(), b, out=b.clone()), want.bfloat16())
    into = total.clone()
    assert grad_sums.add_into(into, b, out=into) is into and torch.equal(into, want)
    wide = total.double()  # float64 sums add in float64
    assert torch.equal(grad_sums.add_into(wide, b, out=wide.clone()), wide + b.double())


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_one_pass_add_kernel_in_bfloat16_on_the_gpu(out_dtype):
    g = torch.Generator("cuda").manual_seed(0)
    for n in (1, 4097, 3584 * 18944 + 5):
        a = torch.randn(n, device="cuda", generator=g).bfloat16()
        b = (torch.randn(n, device="cuda", generator=g) * 1e-3).bfloat16()
        assert torch.equal(grad_sums.pair_sum(a, b, out_dtype), (a.float() + b.float()).to(out_dtype))
    assert torch.equal(grad_sums.pair_sum(a, b, torch.float64, torch.float64), a.double() + b.double())  # not in fp32
    total = torch.randn(n, device="cuda", generator=g)
    want = total + b.float()
    last = b.clone()
    assert grad_sums.add_into(total, last, out=last) is last and torch.equal(last, want.bfloat16())
    grad_sums.add_into(total, b, out=total)  # a middle gradient: into the sum
    assert torch.equal(total, want)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [{}, {"compile_layers": True, "keep_attention": True}])
def test_sums_on_the_gpu_equal_adding_every_gradient_bitwise(monkeypatch, kwargs):
    """Two layers of Qwen2.5-7B width, 4 chunks, the Triton backend (and compiled layers)."""
    from oomb.presets import load_model
    torch.manual_seed(0)
    model = load_model("qwen2.5-7b", dtype=torch.bfloat16, device="cuda", num_hidden_layers=2).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 8192), device="cuda")
    args = dict(chunk_size=2048, backend="triton", **kwargs)
    want = grads_with(monkeypatch, AddEveryGradient, model, ids, **args)
    Watched.seen = []
    got = grads_with(monkeypatch, Watched, model, ids, **args)
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, differ
    assert Watched.seen[-1][0] == len(want) - 2
