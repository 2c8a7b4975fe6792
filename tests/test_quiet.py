"""`import oomb` prints nothing: optional packages that transformers' model code imports without
being asked (torchao) log nothing, and oomb itself imports the optional ones it uses (peft,
liger_kernel, torchao's optimizers and float8) only when a feature asks for them."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_oomb_prints_nothing():
    code = ("import sys, oomb, oomb.cli, oomb.train.trainer\n"
            "print(sorted(m for m in ('liger_kernel', 'peft') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    assert out.stdout == "[]\n"


def test_quiet_loggers_restores_their_levels():
    import logging

    from oomb.models.quiet import quiet_loggers

    logging.getLogger("torchao").setLevel(logging.INFO)
    with quiet_loggers():
        assert logging.getLogger("torchao").level == logging.ERROR
    assert logging.getLogger("torchao").level == logging.INFO
    logging.getLogger("torchao").setLevel(logging.NOTSET)
