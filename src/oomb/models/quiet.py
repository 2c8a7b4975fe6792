"""Importing transformers' model code without the log lines of optional packages that oomb's
run does not use.

transformers' modeling_utils imports its quantizers, and the torchao one imports torchao
whenever it is installed, quantized model or not. torchao's import then logs a line for each
of its CUDA extensions that does not load (a CPU machine, or a wheel built for another
Python or torch), and its enum registrations log torch pytree deprecations: noise in every
`oomb train`, from a package the run never calls. oomb itself imports torchao only for what
needs it (`--optimizer adamw8bit`, `--float8`) and liger_kernel only for `--liger`; this
silences those two loggers while transformers' model code is first imported, and nothing else,
nothing after. `import oomb` imports no model code (its adapters import their family's RoPE
when a model exists): what makes a model from a config or a checkpoint (presets.load_model,
plan's parameter count, the adapter lookup) calls import_model_code() first.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import sys

# Loggers of what transformers' model code imports without being asked (level raised to ERROR).
NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(names=NOISY_LOGGERS, level: int = logging.ERROR):
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, before):
            lg.setLevel(lv)


def import_model_code() -> None:
    """Import transformers.modeling_utils (what every model module imports first) quietly, once;
    a no-op where it, or torchao, was imported before."""
    if "transformers.modeling_utils" in sys.modules or "torchao" in sys.modules:
        return
    with quiet_loggers():
        importlib.import_module("transformers.modeling_utils")
