#!/usr/bin/env bash
# The demo: start the OpenAI-compatible server on SmolLM2-135M-Instruct (one GGUF file, installed
# by scripts/setup.sh), answer one chat request over HTTP, then stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
model=$(.venv/bin/python -c 'from kestrel.demo import smollm2_gguf; print(smollm2_gguf())')
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/python -m kestrel serve "$model" --port "$port" --served-model-name demo &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  sleep 0.5
done
echo "POST /v1/chat/completions"
curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
echo
