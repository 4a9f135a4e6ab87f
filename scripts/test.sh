#!/usr/bin/env bash
# Lint, then the whole test suite (CPU; Triton kernels run under its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kestrel tests
.venv/bin/ruff format --check kestrel tests
# Both cores: test files spread over two workers, each module's tests kept on one (its fixtures).
.venv/bin/python -m pytest -q -n 2 --dist loadscope
