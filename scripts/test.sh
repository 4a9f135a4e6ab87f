#!/usr/bin/env bash
# Lint, then the whole test suite (or, with --fast, its fast tier) (CPU; Triton kernels run under its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check kestrel tests
.venv/bin/ruff format --check kestrel tests
# Both cores: test files spread over two workers, each module's tests kept on one (its fixtures).
# `--fast`: the inner loop's tier, without the slow and Triton-interpreter tests (conftest.py).
if [[ "${1:-}" == "--fast" ]]; then
    .venv/bin/python -m pytest -q -n 2 --dist loadscope -m "not slow and not triton_interpreter"
else
    .venv/bin/python -m pytest -q -n 2 --dist loadscope
fi
