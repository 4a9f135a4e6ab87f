#!/usr/bin/env bash
# Everything to check on a GPU machine, in one call: the CUDA tests (compiled Triton kernels,
# HF parity on CUDA), then the latency and throughput benchmarks on a Llama-3-8B shape.
# Results go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/core tests/test_hf_parity.py 2>&1 | tee "$out/tests.log" | tail -n 30
python3 -m kestrel bench latency --dummy-config llama-3-8b --dtype bfloat16 --device cuda \
    --input-len 128 --output-len 256 --max-model-len 4096 --kv-cache-memory-gb 16 \
    --output-json "$out/latency.json" 2>&1 | tee "$out/latency.log" | tail -n 40
python3 -m kestrel bench throughput --dummy-config llama-3-8b --dtype bfloat16 --device cuda \
    --num-prompts "${THROUGHPUT_PROMPTS:-256}" --input-len 128 --output-len 128 --max-model-len 4096 \
    --kv-cache-memory-gb 40 --no-hf-baseline --output-json "$out/throughput.json" 2>&1 | tee "$out/throughput.log" | tail -n 20
