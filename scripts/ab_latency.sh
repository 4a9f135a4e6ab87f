#!/usr/bin/env bash
# One request's decode latency (`bench latency`, 128 -> 256 tokens, dummy weights) of several
# source trees, each shape's trees one after the other, so that a change is timed against its
# base in the same run on the same machine. A tree is any folder holding `kestrel/`:
#
#   git archive BASE kestrel | tar -x -C /tmp/base
#   bash scripts/ab_latency.sh /tmp/base . -- qwen3-30b-a3b "llama-3-8b --quantization fp8"
#
# One line per run: tree, shape, ms per token, the bandwidth limit of the same run, the ratio.
# DEVICE (default cuda) and DTYPE (default bfloat16) choose where and in what it runs.
set -uo pipefail
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$(cd "$1" && pwd)"); shift; done
[ $# -gt 0 ] && shift
if [ ${#trees[@]} -eq 0 ] || [ $# -eq 0 ]; then
  echo "usage: bash scripts/ab_latency.sh TREE... -- SHAPE..." >&2
  exit 2
fi
options="--dtype ${DTYPE:-bfloat16} --device ${DEVICE:-cuda} --max-model-len 4096 --kv-cache-memory-gb 8"
options="$options --input-len 128 --output-len 256 --no-hf-baseline"
for shape in "$@"; do
  for tree in "${trees[@]}"; do
    # shellcheck disable=SC2086  # a shape carries its own extra arguments
    report=$(cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 -m kestrel bench latency \
      --dummy-config $shape $options 2>/dev/null)
    echo "$report" | python3 -c '
import json, sys
tree, shape = sys.argv[1:3]
text = sys.stdin.read()
try:
    r = json.loads(text[text.find("{"):])
except json.JSONDecodeError:  # the run failed: no report
    r = {}
ms, limit = r.get("kestrel", {}).get("decode_ms_per_token"), r.get("bandwidth_limit_ms_per_token")
print(f"{tree}  {shape}  " + (f"{ms:.3f} ms, limit {limit:.3f}, {ms / limit:.2f}x" if ms else "failed"))
' "$tree" "$shape"
  done
done
