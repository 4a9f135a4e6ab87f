#!/usr/bin/env bash
# Lint, then the whole test suite (CPU; Triton kernels run under its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kestrel tests
.venv/bin/ruff format --check kestrel tests
.venv/bin/python -m pytest -q
