"""oomb.auto: the fastest engine settings the memory plan says fit a machine, checked against a
brute-force search of the same settings, on GPUs of 24 to 140 GiB and several host sizes; the
error when nothing fits; and the trainer's retry after a first step that runs out of memory."""
import pytest
import torch

from oomb.auto import AUTO_FIELDS, Machine, NothingFits, candidates, choose, chunk_sizes, compiles, judge, step_cost
from oomb.config import EngineConfig
from oomb.plan import gpu_margin, longest_context
from oomb.presets import preset_config

GIB = 2**30
BASE = EngineConfig(offload="auto", keep_attention=None, compile_layers=True)
LORA = dict(trainable_params=20_185_088)  # Qwen2.5-7B, r=16 on q, k, v, o


def brute_force(config, seq_len, machine, base, free=AUTO_FIELDS, **plan_args):
    """Every setting's (cost, fits), by plan and placement alone."""
    out = []
    for engine in candidates(base, free, seq_len):
        fit = judge(config, seq_len, 1, engine, machine, plan_args)[1]
        d = fit.decision
        share = d.host_layers / (d.host_layers + d.device_layers) if d and d.host_layers else 0.0
        out.append((step_cost(engine, share), fit.fits, engine, fit))
    return out


@pytest.mark.parametrize("gpu_gib", [24, 48, 80, 140])
@pytest.mark.parametrize("host_gib", [64, 128, 512])
@pytest.mark.parametrize("seq_len,lora", [(2**18, True), (2**20, True), (2**16, False), (2**18, False)])
def test_choice_is_the_fastest_setting_that_fits(gpu_gib, host_gib, seq_len, lora):
    config = preset_config("qwen2.5-7b")
    machine = Machine(gpu_gib * GIB, host_gib * GIB)
    args = LORA if lora else {}
    every = brute_force(config, seq_len, machine, BASE, **args)
    fitting = [c for c in every if c[1]]
    if not fitting:
        with pytest.raises(NothingFits, match="the longest context they fit is"):
            choose(config, seq_len, machine, BASE, **args)
        return
    choice = choose(config, seq_len, machine, BASE, **args)
    assert choice.cost == min(c[0] for c in fitting)
    assert choice.fit.fits and choice.fit.gpu <= machine.gpu_bytes and choice.fit.host <= machine.host_bytes
    # what the step is planned to take on the GPU leaves 5 % of it free
    assert choice.fit.gpu - gpu_margin(machine.gpu_bytes) <= 0.95 * machine.gpu_bytes
    assert choice.chosen == AUTO_FIELDS and 2 * choice.engine.chunk_size <= seq_len
    assert "auto configuration: chunk" in choice.summary() and "(chosen:" in choice.summary()


def test_small_gpus_reach_long_contexts_with_lora():
    """Issue #34's targets as the plan sees them: a 7B LoRA step of 256K within 24 GiB and of 1M
    within 48 GiB (with 128 GiB of host memory), layers recomputed and bf16 dK/dV where needed."""
    config = preset_config("qwen2.5-7b")
    small = choose(config, 2**18, Machine(24 * GIB, 120 * GIB), BASE, **LORA)
    assert small.fit.fits and small.fit.decision.host_layers > 0
    big = choose(config, 2**20, Machine(48 * GIB, 120 * GIB), BASE, **LORA)
    assert big.fit.fits and big.engine.kv_grad_dtype == torch.bfloat16


def test_given_fields_are_kept():
    config = preset_config("qwen2.5-7b")
    machine = Machine(140 * GIB, 110 * GIB)
    given = BASE.replace(chunk_size=2048, kv_grad_dtype=torch.bfloat16)
    choice = choose(config, 2**17, machine, given, free=("checkpoint_layers",))
    assert (choice.engine.chunk_size, choice.engine.kv_grad_dtype) == (2048, torch.bfloat16)
    assert choice.chosen == ("checkpoint_layers",)
    with pytest.raises(ValueError, match=r"cannot choose \['offload'\]"):
        choose(config, 2**17, machine, BASE, free=("offload",))


def test_nothing_fits_names_the_longest_context_that_does():
    config = preset_config("qwen2.5-7b")
    machine = Machine(24 * GIB, 64 * GIB)
    with pytest.raises(NothingFits) as e:
        choose(config, 2**20, machine, BASE, **LORA)
    msg = str(e.value)
    assert "1 x 1,048,576 tokens do not fit this machine (GPU 24.0 GiB, host 64.0 GiB)" in msg
    longest = int(msg.split("the longest context they fit is ")[1].split(" tokens")[0].replace(",", ""))
    # that length fits (a setting is found), one chunk more does not with the most frugal settings
    assert choose(config, longest, machine, BASE, **LORA).fit.fits
    frugal = BASE.replace(chunk_size=1024, kv_grad_dtype=torch.bfloat16, checkpoint_layers=True)
    assert longest == longest_context(lambda n: judge(config, n, 1, frugal, machine, LORA)[1].fits, 1024)
    assert "(chunk 1024, offload auto" in msg and "bf16 dK/dV, layers recomputed in backward" in msg
    # full-parameter gradients: LoRA is named as what would go further
    with pytest.raises(NothingFits, match=r"LoRA \(--lora-rank 16\)"):
        choose(config, 2**20, machine, BASE)


@pytest.mark.parametrize("trainer", [False, True])
def test_nothing_fits_a_full_parameter_step_names_what_halves_its_state(trainer):
    """80 GiB, a 1M top-k full-parameter step with fp32 gradient sums and AdamW: just short. The
    error names bf16 sums and 8-bit AdamW with the longest context each reaches, which fits."""
    from oomb import TopKPages

    config = preset_config("qwen2.5-7b")
    machine = Machine(80 * GIB, 110 * GIB)
    base = BASE.replace(sparse=TopKPages(budget=64), param_grad_dtype=torch.float32)
    n = 7_615_616_512  # the 7B's parameters: the trainer passes them, all trainable (oomb plan passes neither)
    args = dict(trainable_params=n, n_params=n) if trainer else {}
    with pytest.raises(NothingFits) as e:
        choose(config, 2**20, machine, base, **args)
    msg = str(e.value)
    assert "LoRA (--lora-rank 16)" in msg
    for words, engine, extra in (("gradient sums in the weights' dtype (--param-grad-dtype param)",
                                  base.replace(param_grad_dtype=None), {}),
                                 ("8-bit AdamW (--optimizer adamw8bit)", base, {"optimizer_bytes_per_param": 2})):
        reach = int(msg.split(f"With {words} ")[1].split(" tokens")[0].replace(",", ""))
        assert reach >= 2**20 and choose(config, reach, machine, engine, **args, **extra).fit.fits
    # 48 GiB: the weights, gradients and AdamW's state alone are more than the GPU may use
    with pytest.raises(NothingFits) as e:
        choose(config, 2**18, Machine(48 * GIB, 110 * GIB), base, **args)
    assert "alone take 70.9 GiB of the 45.6 GiB the GPU may use" in str(e.value)
    assert "More host memory" not in str(e.value)
    # a run already on bf16 sums and 8-bit AdamW is not told to use them
    with pytest.raises(NothingFits) as e:
        choose(config, 2**21, machine, base.replace(param_grad_dtype=None), **args, optimizer_bytes_per_param=2)
    assert "--param-grad-dtype" not in str(e.value) and "adamw8bit" not in str(e.value)


def test_a_retry_takes_less_working_memory():
    config = preset_config("qwen2.5-7b")
    machine = Machine(140 * GIB, 110 * GIB)
    first = choose(config, 2**16, machine, BASE)
    second = choose(config, 2**16, machine, BASE, below=first)
    assert second.plan.working_set < first.plan.working_set and second.cost >= first.cost
    last = first
    with pytest.raises(NothingFits, match="no setting needs less working memory than the one that ran out"):
        for _ in range(20):
            last = choose(config, 2**16, machine, BASE, below=last)


def test_chunk_sizes_and_compile_rule():
    assert chunk_sizes(2**16, 128) == [16384, 8192, 4096, 2048, 1024]
    assert chunk_sizes(4096, 128) == [2048, 1024] and chunk_sizes(1000, 128) == [384, 128]
    assert chunk_sizes(256, 128) == [128] and chunk_sizes(100, 128) == [128]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compiles(preset_config("qwen2.5-7b"), cuda, lora=False)
    assert not compiles(preset_config("qwen2.5-7b"), cuda, lora=True)
    assert not compiles(preset_config("qwen2.5-7b"), cpu, lora=False)
    assert not compiles(preset_config("gpt-oss-20b"), cuda, lora=False)


def test_kept_attention_never_makes_a_setting_fail():
    """keep_attention None keeps outputs only in the room left: the fit is judged without them."""
    config = preset_config("qwen2.5-7b")
    machine = Machine(140 * GIB, 110 * GIB)
    kept = choose(config, 2**20, machine, BASE)
    none = choose(config, 2**20, machine, BASE.replace(keep_attention=False))
    assert kept.engine.replace(keep_attention=False) == none.engine
    assert kept.plan.kept_attention > 0


def test_trainer_retries_a_first_step_that_runs_out_of_memory(monkeypatch, capsys):
    """The plan was wrong (simulated: the first step raises torch.OutOfMemoryError): the trainer
    frees, re-plans one notch smaller, says so, and the run goes on."""
    import oomb
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import train

    real = oomb.ChunkRecurrentEngine.forward_backward
    sizes = []

    def forward_backward(self, *a, **k):
        sizes.append(self.chunk_size)
        if len(sizes) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *a, **k)

    monkeypatch.setattr(oomb.ChunkRecurrentEngine, "forward_backward", forward_backward)
    losses = train(TrainConfig(seq_len=1024, page_size=64, steps=2, backend="torch", device="cpu"))
    out = capsys.readouterr().out
    assert len(losses) == 2 and sizes == [512, 512, 512]
    assert out.splitlines()[0].startswith("oomb train: no --output-dir: nothing will be saved")
    assert "oomb train: auto configuration: chunk 512" in out.splitlines()[1]
    # the next fastest setting with a smaller working set: each layer recomputed (chunk 256 costs more)
    assert ("step 1 ran out of GPU memory with chunk 512, offload auto, fp32 dK/dV, layers kept in backward; "
            "retrying with chunk 512, offload auto, fp32 dK/dV, layers recomputed in backward") in out


def test_trainer_does_not_retry_given_settings(monkeypatch):
    import oomb
    from oomb.train.config import TrainConfig
    from oomb.train.trainer import train

    def forward_backward(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(oomb.ChunkRecurrentEngine, "forward_backward", forward_backward)
    with pytest.raises(torch.OutOfMemoryError):
        train(TrainConfig(seq_len=512, chunk_size=128, page_size=64, kv_grad_dtype="float32",
                          checkpoint_layers=False, steps=1, backend="torch", device="cpu"))


def test_top_k_prefers_chunks_near_its_measured_optimum():
    """Top-k attends each chunk's own keys densely, so its cost grows with the chunk: 4096 (the
    measured best of 2048 / 4096 / 8192 at 256K) where dense takes the largest that fits."""
    from oomb.attention.sparse import TopKPages

    config = preset_config("qwen2.5-7b")
    machine = Machine(140 * GIB, 110 * GIB)
    sparse = choose(config, 2**18, machine, BASE.replace(sparse=TopKPages(budget=64)))
    dense = choose(config, 2**18, machine, BASE)
    assert sparse.engine.chunk_size == 4096 and dense.engine.chunk_size == 8192
    costs = {c: step_cost(BASE.replace(chunk_size=c, sparse=TopKPages(budget=64))) for c in (2048, 4096, 8192)}
    assert costs[4096] < costs[2048] < costs[8192]
    assert costs[2048] / costs[4096] == pytest.approx(1.031, abs=0.005)
    assert costs[8192] / costs[4096] == pytest.approx(1.12, abs=0.005)


def test_a_per_process_memory_fraction_is_the_gpu_planned_for(monkeypatch):
    """torch.cuda.set_per_process_memory_fraction caps what the caching allocator may hold, which
    the driver's free memory does not show: the plan, the engine's 'auto' room and its margin
    take the cap as the GPU (how a 24 GiB GPU is emulated on an H200)."""
    from oomb.memory.device import device_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 8 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.2, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # 'cuda' is the current device's index
    cuda = torch.device("cuda")
    assert device_memory(cuda) == (28 * GIB - 8 * GIB, 28 * GIB)  # the cap less what is allocated
    assert Machine.measure(cuda).gpu_bytes == 28 * GIB
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    assert device_memory(cuda) == (100 * GIB + 2 * GIB, 140 * GIB)  # free, and the cache's unused blocks
