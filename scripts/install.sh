#!/usr/bin/env bash
# Install oomb (and with --dev its test tools: pytest, torchao for the adamw8bit tests, pyarrow and
# datasets for the data-format tests, tensorboard for the --report-to read-back test). Keeps a torch
# that is already installed (a CUDA build on a GPU machine); otherwise takes torch 2.13.0, which on
# the project's CPU machines is a local CPU build (an unpinned torch would download a multi-GB CUDA
# build).
#
# Offline, with the dependencies installed, it installs without fetching anything: pip's default
# build runs in an isolated environment into which it downloads setuptools. So the build uses
# this Python's setuptools where it can build oomb (>= 70.1, or >= 68 with the wheel package);
# else pip's isolated build (online); else, offline in a venv whose own setuptools is too old
# (a Python 3.11 venv has ensurepip's 65.5, without wheel, below torch's own requirement), a new
# enough setuptools from another site-packages directory of this Python (a --system-site-packages
# venv sees the system's).
#
# Run again, it returns at once when this checkout is already installed (editable) with every
# requirement of pyproject.toml (and --dev's) met, and installs only oomb itself (pip --no-deps)
# when those are met but it is not (another checkout, version or entry point). Python < 3.11 (no
# tomllib) goes through pip's resolver every time.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"

# exit 0: oomb is installed from this checkout and every requirement is met; 2: the requirements
# are met, oomb is not (or another checkout's); 1: a requirement is missing or too old
installed='
import importlib.metadata as md, json, os, sys, tomllib
from packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = project["dependencies"] + (project["optional-dependencies"]["dev"] if sys.argv[1] else [])
for req in map(Requirement, wanted):
    if req.marker is None or req.marker.evaluate():
        if not req.specifier.contains(md.version(req.name), prereleases=True):
            sys.exit(1)
try:
    dist = md.distribution("oomb")
except md.PackageNotFoundError:
    sys.exit(2)
url = json.loads(dist.read_text("direct_url.json") or "{}")
here = "file://" + os.path.realpath(".")
sys.exit(2 if url.get("url") != here or not url.get("dir_info", {}).get("editable")
         or dist.version != project["version"]
         or {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"} != project["scripts"] else 0)'
state=0
python3 -c "$installed" "$extras" 2>/dev/null || state=$?
if [ $state = 0 ]; then
    echo "install.sh: oomb is installed from this checkout with every requirement met; nothing to do"
    exit 0
fi
no_deps=""
if [ $state = 2 ]; then
    no_deps="--no-deps"  # what oomb needs is there: no resolver run
else
    python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
fi
install() { python3 -m pip install -q $no_deps "$@" -e ".${extras}"; }

can_build='
import importlib.util, sys, setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(not (v >= (70, 1) or (v >= (68, 0) and importlib.util.find_spec("wheel"))))'
# The site-packages directory of this Python with the newest setuptools >= 70.1, if any.
other_setuptools='
import glob, os, site, sys
found = []
for d in site.getsitepackages():
    for info in glob.glob(os.path.join(d, "setuptools-*.dist-info")):
        v = tuple(int(x) for x in os.path.basename(info)[11:].split(".")[:2] if x.isdigit())
        if v >= (70, 1):
            found.append((v, d))
if not found:
    sys.exit(1)
print(max(found)[1])'

if python3 -c "$can_build" 2>/dev/null; then
    install --no-build-isolation || install  # nothing to fetch
elif ! isolated=$(install 2>&1); then
    site_dir=$(python3 -c "$other_setuptools") || {
        echo "$isolated" >&2
        echo "install.sh: pip could not fetch setuptools for the build (offline?), and this Python has no" \
             "setuptools >= 70.1 to build with: run 'python3 -m pip install -U setuptools' once online" >&2
        exit 1
    }
    # First on the path, its setuptools (and its metadata, which pip checks torch's requirement on)
    # shadows the venv's own for this command only.
    echo "install.sh: pip's isolated build could not fetch setuptools (offline?); building with the" \
         "setuptools in $site_dir" >&2
    PYTHONPATH="$site_dir" install --no-build-isolation
else
    [ -z "$isolated" ] || echo "$isolated"
fi
