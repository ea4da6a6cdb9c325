#!/usr/bin/env bash
# Issue 57's proof runs, side by side with llama.cpp on the same GGUF files: prefill at 512 / 4,096 / 16,384 tokens,
# decode at batch 1, and decode over a cached prompt of 4,096 / 16,384 / 32,000 tokens (`bench latency --depth`,
# against `llama-bench -d`) at each KV cache dtype, on the instruct model (exact path, then with
# --activation-quantization int8) and on the default model. Each run writes docs/bench/latency_depth_*.json and .png
# and prints its tables; the markdown of each run's tables is written beside its JSON (.md) for docs/BENCHMARKS.md.
#
# Run it on a quiet machine (load average near 0, nothing else on the cores): every figure is a time. It checks the
# load first and refuses above --max-load (default 0.5). About 3 hours on 2 cores of the hosts this project sees
# (llama-bench's prefill of 32,000 tokens alone is ~10 minutes a cache type; kvserve's, ~4 minutes a KV dtype).
#
# Usage: scripts/bench_decode_depth.sh [--llama-bench PATH] [--out-dir docs/bench] [--max-load 0.5] [--only NAME]
#   NAME: instruct, instruct_int8 or default (each run alone)
set -euo pipefail

LLAMA_BENCH="${LLAMA_BENCH:-/work/llama.cpp/bin/llama-bench}"
OUT="docs/bench"
MAX_LOAD="0.5"
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --llama-bench) LLAMA_BENCH="$2"; shift 2 ;;
        --out-dir) OUT="$2"; shift 2 ;;
        --max-load) MAX_LOAD="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
[ -x "$LLAMA_BENCH" ] || { echo "error: no llama-bench at $LLAMA_BENCH (scripts/build_llama_cpp.sh builds it)" >&2; exit 1; }
load="$(cut -d' ' -f1 /proc/loadavg)"
if ! python3 -c "import sys; sys.exit(0 if float('$load') <= float('$MAX_LOAD') else 1)"; then
    echo "error: load average $load is above $MAX_LOAD: time these on a quiet machine (or pass --max-load)" >&2
    exit 1
fi
mkdir -p "$OUT"

# The shared workload: prefill lengths against llama-bench pp, batch-1 decode against its tg, the depths against -d.
COMMON=(--prompt-lens 512,4096,16384 --output-len 32 --batch-sizes 1 --batch-output-len 32 --repeats 3
        --depth 4096,16384,32000 --peer llama-cpp --llama-bench "$LLAMA_BENCH" --llama-cpp-kv-types f16,q8_0)

run() {  # NAME, then the bench latency flags of that run
    local name="$1"; shift
    if [ -n "$ONLY" ] && [ "$ONLY" != "$name" ]; then return; fi
    echo "== $name (load average $(cut -d' ' -f1 /proc/loadavg))"
    kvserve bench latency "${COMMON[@]}" "$@" \
        --json "$OUT/latency_depth_$name.json" --plot "$OUT/latency_depth_$name.png"
    # The run's tables as markdown beside its JSON, for docs/BENCHMARKS.md.
    python3 -c 'import json, sys
from kvserve.bench.docs import render_section
path, command = sys.argv[1], sys.argv[2]
doc = json.load(open(path))
open(path[: -len(".json")] + ".md", "w").write(render_section(doc, path, command) + "\n")' \
        "$OUT/latency_depth_$name.json" "kvserve bench latency ${COMMON[*]} $*"
}

# The instruct model (the agents' model): float32 KV (the CPU default), the two 16-bit dtypes and int8.
run instruct --model qwen2.5-coder-0.5b-instruct --depth-kv-cache-dtypes float16,bfloat16,int8
# The same with llama.cpp's own arithmetic on its Q8_0 activations (--activation-quantization int8).
# bfloat16 first: on a CPU with AVX512_BF16 its attention takes bfloat16 dot products (docs/KV_QUANT.md).
run instruct_int8 --model qwen2.5-coder-0.5b-instruct --activation-quantization int8 \
    --depth-kv-cache-dtypes bfloat16,float16,int8
# The default model (Gemma 3 270M: one KV head of 256, sliding windows of 512 on 15 of its 18 layers).
run default --depth-kv-cache-dtypes bfloat16,float16,int8
