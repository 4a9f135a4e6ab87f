#!/usr/bin/env bash
# Everything to check on a GPU machine, in phases that each fit one 10-minute call:
#   bash scripts/gpu_check.sh tests       # the kernel tests, compiled (core, layers), in parallel
#   bash scripts/gpu_check.sh parity      # HF parity on CUDA (eager, graphs), overlapped steps
#   bash scripts/gpu_check.sh gemv        # the one-row matvec vs cuBLAS per weight shape
#   bash scripts/gpu_check.sh latency     # batch-1 latency (dependent launch off, then on), decode profile
#   bash scripts/gpu_check.sh throughput  # 1000 x 128/128 and 1000 x 1000/1000, step timeline
#   bash scripts/gpu_check.sh attention   # decode attention over bf16 vs float8 pools, 256 x 1500 and batch 1
#   bash scripts/gpu_check.sh fp8         # float8 decode sweep; 1000 x 1000/1000 and step timelines with float8
#   bash scripts/gpu_check.sh steps       # device timelines of decode and prefill steps, SM clocks and power
#   bash scripts/gpu_check.sh prefill     # the prefill kernel's launch sweep, then whole prefill steps per kernel
#   bash scripts/gpu_check.sh long        # 1000 x 2048/2048
#   bash scripts/gpu_check.sh tp          # two GPUs: TP=2 parity, all-reduce bandwidth, TP=1 vs TP=2
#   bash scripts/gpu_check.sh moe         # the fused MoE's launch sweep per token count (fills LAUNCHES)
#   bash scripts/gpu_check.sh sparse      # Qwen3-30B-A3B, Qwen3-Next and DeepSeek-V2-Lite shapes: batch-1
#                                         # latency, decode profile, 1000 x 1000/1000 with a float8 pool
#                                         # (carry the fla-core wheel for HF's Qwen3-Next)
# Llama-3-8B shape with dummy bf16 weights; results go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off: on a shared host it can put the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
B="--dummy-config llama-3-8b --dtype bfloat16 --device cuda --max-model-len 4096"
throughput() {  # input_len output_len [kv cache dtype]
    local kv=${3:-auto}
    python3 -m kestrel bench throughput $B --num-prompts 1000 --input-len "$1" --output-len "$2" \
        --kv-cache-dtype "$kv" --no-hf-baseline --output-json "$out/throughput_$1_$2_$kv.json" 2>&1 |
        tee "$out/throughput_$1_$2_$kv.log" | tail -n 6
}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$out/env.txt"
for phase in "${@:-tests}"; do
    case "$phase" in
    tests)  # every kernel compiled, against the torch reference
        # Most of the time goes to compiling each case's kernel variants (12-40 s a case in one
        # process), so the cases are spread over workers where pytest-xdist is installed. A test
        # still running after 2 minutes dumps every thread's stack; each suite has its own timeout.
        workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
        for suite in core:400 layers:150; do
            timeout "${suite#*:}" python3 -m pytest -q -p no:cacheprovider $workers -o faulthandler_timeout=120 \
                --durations=10 "tests/${suite%:*}" 2>&1 | tee "$out/tests_${suite%:*}.log" | tail -n 30
        done
        ;;
    parity)  # HF parity eager and with graphs, overlapped steps, dependent launches
        python3 -m pytest -q -p no:cacheprovider tests/test_hf_parity.py tests/engine/test_async_scheduling.py \
            tests/engine/test_dependent_launch_decode.py 2>&1 | tee "$out/parity.log" | tail -n 30
        ;;
    gemv)
        python3 scripts/gemv_bench.py 2>&1 | tee "$out/gemv.log"
        ;;
    latency)  # with dependent launch off, then on (the default) beside HF
        python3 -m kestrel bench latency $B --no-dependent-launch --input-len 128 --output-len 256 \
            --no-hf-baseline --output-json "$out/latency_independent.json" 2>&1 |
            tee "$out/latency_independent.log" | tail -n 8
        python3 -m kestrel bench latency $B --input-len 128 --output-len 256 \
            --output-json "$out/latency.json" 2>&1 | tee "$out/latency.log" | tail -n 25
        python3 scripts/profile_decode.py --out "$out/profile" 2>&1 | tail -n 20
        ;;
    throughput)
        throughput 128 128
        throughput 1000 1000
        python3 scripts/step_timeline.py --dummy-config llama-3-8b --dtype bfloat16 --device cuda \
            --num-prompts 256 --input-len 1000 --output-len 200 --sync-debug \
            --out "$out/timeline.json" 2>&1 | tail -n 20
        ;;
    attention)
        python3 scripts/attention_bench.py --quick 2>&1 | tee "$out/attention.log"
        python3 scripts/attention_bench.py --quick --batch 1 --context 384 2>&1 | tee -a "$out/attention.log"
        ;;
    fp8)  # the float8 pool's launch sweep, 1000 x 1000/1000, and its steps beside bf16's
        python3 scripts/attention_bench.py --float8-stages 2>&1 | tee "$out/attention_sweep.log"
        throughput 1000 1000 fp8
        for kv in auto fp8; do
            python3 scripts/step_timeline.py --dummy-config llama-3-8b --dtype bfloat16 --device cuda \
                --kv-cache-dtype $kv --num-prompts 256 --input-len 1000 --output-len 200 \
                --out "$out/timeline_$kv.json" 2>&1 | tail -n 4
        done
        ;;
    steps)  # where a 1000 x 1000/1000 run's steps go, per kernel, while the clocks are sampled
        nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
            >"$out/clocks.csv" &
        sampler=$!
        for kv in auto fp8; do
            python3 scripts/step_timeline.py --dummy-config llama-3-8b --dtype bfloat16 --device cuda \
                --kv-cache-dtype $kv --num-prompts 1000 --input-len 1000 --output-len 1000 \
                --trace-from 400 --trace-steps 5 --out "/tmp/decode_$kv.json" 2>&1 | grep -v USDT | head -n 12
            python3 scripts/profile_prefill.py --kv-cache-dtype $kv --out "/tmp/prefill_$kv.json" 2>&1 |
                grep -v USDT | head -n 40
            cp "/tmp/decode_$kv.trace.summary.json" "/tmp/prefill_$kv.json" "$out/"
        done
        kill $sampler
        ;;
    prefill)  # 8 fresh prompts of 1,000 tokens: the kernel alone, then engine steps traced
        python3 scripts/attention_bench.py --prefill --context 1000 2>&1 | tee "$out/prefill_sweep.log"
        python3 scripts/profile_prefill.py --out "/tmp/prefill.json" 2>&1 | grep -v USDT | head -n 40
        cp /tmp/prefill.json "$out/"
        ;;
    long)
        throughput 2048 2048
        ;;
    tp)  # in one call: ~2 min of tests, then each TP size's latency and 1000 x 1000/1000
        python3 -m pytest -q -p no:cacheprovider tests/engine/test_tensor_parallel.py -k gpus 2>&1 |
            tee "$out/tp_tests.log" | tail -n 5
        python3 scripts/allreduce_bench.py --world-size 2 2>&1 | tee "$out/allreduce.log"
        for tp in 1 2; do
            python3 -m kestrel bench latency $B -tp $tp --input-len 128 --output-len 256 --no-hf-baseline \
                --output-json "$out/latency_tp$tp.json" 2>&1 | tail -n 6
            python3 -m kestrel bench throughput $B -tp $tp --num-prompts 1000 --input-len 1000 --output-len 1000 \
                --no-hf-baseline --output-json "$out/throughput_tp$tp.json" 2>&1 | tail -n 6
        done
        ;;
    moe)
        python3 scripts/moe_sweep.py --out "$out/moe_sweep.json" 2>&1 | grep -v skip | tee "$out/moe_sweep.log"
        ;;
    sparse)  # the MoE and hybrid shapes against their honest limits (bench/limits.py)
        # Throughput with a float8 pool and 512 sequences: what the issue's targets are measured with.
        for shape in qwen3-30b-a3b qwen3-next-80b-a3b-24l deepseek-v2-lite; do
            S="--dummy-config $shape --dtype bfloat16 --device cuda --max-model-len 4096"
            python3 -m kestrel bench latency $S --input-len 128 --output-len 256 --hf-output-len 32 \
                --kv-cache-memory-gb 8 --output-json "$out/latency_$shape.json" 2>&1 |
                tee "$out/latency_$shape.log" | tail -n 30
            python3 scripts/profile_decode.py --dummy-config $shape --context 0 --kv-cache-memory-gb 8 \
                --out "$out/profile_$shape" 2>&1 | tail -n 12
            python3 -m kestrel bench throughput $S --num-prompts 1000 --input-len 1000 --output-len 1000 \
                --kv-cache-dtype fp8 --max-num-seqs 512 --no-hf-baseline \
                --output-json "$out/throughput_$shape.json" 2>&1 | tee "$out/throughput_$shape.log" | tail -n 6
        done
        ;;
    *)
        echo "unknown phase $phase (tests, parity, gemv, latency, throughput, attention, fp8, steps, prefill, long, tp, moe, sparse)" >&2
        exit 2
        ;;
    esac
done
