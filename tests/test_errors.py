"""Bad input fails at the boundary with a message naming the value, the limit and the fix."""
import pytest
import torch
from torch import nn

import oomb
from tiny_models import make_model


@pytest.fixture(scope="module")
def model():
    return make_model("qwen2")


def test_chunk_not_multiple_of_page(model):
    with pytest.raises(ValueError, match=r"chunk_size=100 is not a multiple of page_size=16; use chunk_size=96"):
        oomb.ChunkRecurrentEngine(model, chunk_size=100, page_size=16)


def test_unsupported_model_names_supported_ones():
    supported = ("LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, "
                 "Qwen3ForCausalLM, Qwen3MoeForCausalLM")
    with pytest.raises(TypeError, match=rf"Linear is not supported.*{supported}"):
        oomb.ChunkRecurrentEngine(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="must be a transformers causal LM"):
        oomb.ChunkRecurrentEngine("Qwen/Qwen2.5-7B")


@pytest.mark.parametrize("kwargs,match", [
    ({"offload": "disk"}, r"offload='disk' is not one of"),
    ({"sparse": "topk"}, r"sparse='topk' must be None \(dense\) or oomb.TopKPages"),
    ({"backend": "cuda"}, r"backend='cuda' is not one of"),
    ({"kv_grad_dtype": torch.float16}, r"kv_grad_dtype=torch.float16 must be"),
    ({"kept_host_bytes": -1}, r"kept_host_bytes=-1 must be None"),
    ({"page_size": 48, "chunk_size": 96}, r"page_size=48 must be a power of two"),
])
def test_bad_options(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        oomb.ChunkRecurrentEngine(model, **{"chunk_size": 64, "page_size": 16, **kwargs})


def test_bad_sizes(model):
    with pytest.raises(TypeError, match="chunk_size must be a positive int, got 0"):
        oomb.ChunkRecurrentEngine(model, chunk_size=0)
    with pytest.raises(TypeError, match="page_size must be a positive int, got 16.0"):
        oomb.ChunkRecurrentEngine(model, page_size=16.0)


@pytest.fixture(scope="module")
def engine(model):
    return oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")


def test_seq_len_too_short(engine):
    with pytest.raises(ValueError, match=r"seq_len=1 is too short: at least 2 tokens"):
        engine.forward_backward(torch.tensor([[5]]))


def test_non_integer_ids(engine):
    with pytest.raises(TypeError, match=r"integer token ids, got dtype torch.float32; use input_ids.long\(\)"):
        engine.forward_backward(torch.rand(1, 10))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        engine.forward_backward([[1, 2, 3]])


def test_one_dimensional_ids(engine):
    with pytest.raises(ValueError, match=r"must be \(batch, seq_len\), got shape \(10,\); for one sequence use input_ids\[None\]"):
        engine.forward_backward(torch.arange(10))


def test_labels_shape_mismatch(engine):
    ids = torch.randint(0, 50, (1, 20))
    with pytest.raises(ValueError, match=r"labels shape \(1, 19\) does not match input_ids shape \(1, 20\)"):
        engine.forward_backward(ids, ids[:, 1:])


def test_all_labels_ignored(engine):
    ids = torch.randint(0, 50, (1, 20))
    with pytest.raises(ValueError, match="predict no token"):
        engine.forward_backward(ids, torch.full_like(ids, -100))


def test_attention_dropout_rejected():
    m = make_model("qwen2")
    m.config.attention_dropout = 0.1
    m.train()
    engine = oomb.ChunkRecurrentEngine(m, chunk_size=32, page_size=16)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1.*Set model.config.attention_dropout = 0.0"):
        engine.forward_backward(torch.randint(0, 50, (1, 20)))


def test_sliding_window_config_rejected():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=50, use_sliding_window=True, sliding_window=16,
                      max_window_layers=0)
    with pytest.raises(ValueError, match=r"sliding_attention.*computes full_attention only"):
        oomb.ChunkRecurrentEngine(Qwen2ForCausalLM(cfg))


def test_liger_needs_cuda_and_no_tensor_parallelism():
    from oomb.models.liger import apply_liger
    from oomb.train.config import TrainConfig
    with pytest.raises(ValueError, match="Liger kernels run on CUDA only and this model is on cpu"):
        apply_liger(make_model("qwen2"))
    with pytest.raises(ValueError, match="liger=True with tp=2"):
        TrainConfig(liger=True, tp=2)


def test_gpu_memory_is_checked_before_the_step(model, monkeypatch):
    """offload 'none' on a GPU whose free memory cannot hold the step's pages: refused before any
    compute, with the need, what is free and the fix (the check, on a CPU model made to look like
    a CUDA one)."""
    engine = oomb.ChunkRecurrentEngine(model, chunk_size=32, page_size=16, backend="torch")
    monkeypatch.setattr(engine.memory, "device", torch.device("cuda"))
    monkeypatch.setattr(engine.memory, "free_gpu_bytes", lambda: 2**20)
    # 2 layers x 4 KiB a page x 1,023 pages (16,368 earlier tokens) = 8.0 MiB
    with pytest.raises(ValueError, match=r"the pages of this step need 8.0 MiB more GPU memory, 1.0 MiB is free; "
                                         r"use offload='auto' or offload='all'"):
        engine.memory.check(engine.config, 1, 1023, 0)
