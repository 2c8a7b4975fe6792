"""scripts/install.sh offline: in a new virtual environment that sees this Python's packages
(torch, transformers, ...) and has no package index, it installs a copy of the checkout without
fetching anything (pip's isolated build would fetch setuptools); run again, it does nothing."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_install_offline_into_a_venv_then_nothing_to_do(tmp_path):
    repo = tmp_path / "oomb"  # a copy: this checkout's own install stays as it is
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "scripts"):
        shutil.copytree(os.path.join(ROOT, name), repo / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), repo / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python3"
    if subprocess.run([python, "-c", "import torch, transformers"], capture_output=True).returncode:
        pytest.skip("this Python's torch and transformers are not in its base installation (a nested venv)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def install():
        return subprocess.run(["bash", str(repo / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                              timeout=600)

    first = install()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "nothing to do" not in first.stdout
    where = subprocess.run([python, "-c", "import oomb; print(oomb.__file__)"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert where.stdout.strip() == str(repo / "src" / "oomb" / "__init__.py"), where.stdout + where.stderr
    assert (venv / "bin" / "oomb").exists()
    again = install()
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
