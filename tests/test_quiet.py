"""`import oomb` prints nothing: optional packages that transformers' model code imports without
being asked (torchao) log nothing, and oomb itself imports the optional ones it uses (peft,
liger_kernel, torchao's optimizers and float8) only when a feature asks for them."""
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_oomb_prints_nothing():
    code = ("import sys, oomb\n"
            "model_code = 'transformers.modeling_utils' in sys.modules\n"
            "import oomb.cli, oomb.train.trainer\n"
            "print(model_code, sorted(m for m in ('liger_kernel', 'peft', 'torch.distributed.tensor')\n"
            "                         if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    # no model code either (what makes a model imports it), nor DTensor (what shards one does)
    assert out.stdout == "False []\n"


def test_lora_model_warns_nothing():
    """peft's LoRA wrapping asks transformers 5 a deprecated name (a FutureWarning per model): not
    the user's to act on, so build_model does not pass it on."""
    import warnings

    from oomb.train.config import TrainConfig
    from oomb.train.trainer import build_model

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build_model(TrainConfig(lora_rank=4), torch.device("cpu"))
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]


def test_quiet_loggers_restores_their_levels():
    import logging

    from oomb.models.quiet import quiet_loggers

    logging.getLogger("torchao").setLevel(logging.INFO)
    with quiet_loggers():
        assert logging.getLogger("torchao").level == logging.ERROR
    assert logging.getLogger("torchao").level == logging.INFO
    logging.getLogger("torchao").setLevel(logging.NOTSET)
