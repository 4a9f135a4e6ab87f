#!/usr/bin/env bash
# The demo: write the built-in demo model (if absent) and generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -f demo-model/config.json ] || .venv/bin/python -m kestrel make-demo-model demo-model
.venv/bin/python -m kestrel generate --model demo-model --prompt "Hello, Kestrel!" --prompt "The quick brown fox" --max-tokens 24
