#!/usr/bin/env bash
# Install oomb (and with --dev its test tools: pytest, torchao for the adamw8bit tests). Keeps a
# torch that is already installed (a CUDA build on a GPU machine); otherwise takes torch 2.13.0,
# which on the project's CPU machines is a local CPU build (an unpinned torch would download a
# multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${extras}"
