#!/usr/bin/env bash
# Seconds from launching `kvserve serve --kv-cache-memory-bytes 1GiB` until GET /health answers, and the
# process's peak RSS: a first start with empty caches (HOME pointed at an empty directory, so the model package,
# tokenizer, dequantized and quantized weights and the kernels are all made anew), then two later starts.
# The figures of BENCHMARKS.md's "Start time and memory". Not run by CI.
# Usage: scripts/measure_start.sh [kvserve serve flags, e.g. -q q8_0 to compare a weight format]
set -euo pipefail
fresh="$(mktemp -d)"
trap 'rm -rf "$fresh"' EXIT
serve_flags=("$@")
measure() {
    local start pid
    start=$(date +%s.%N)
    HOME="$fresh" kvserve serve --port 8010 --kv-cache-memory-bytes 1GiB "${serve_flags[@]}" > "$fresh/serve.log" 2>&1 &
    pid=$!
    until curl -sf localhost:8010/health >/dev/null; do sleep 0.05; done
    echo "$1: $(echo "$(date +%s.%N) - $start" | bc) s, peak RSS $(awk '/VmHWM/ {printf "%.2f GiB", $2 / 1048576}' /proc/$pid/status)"
    kill -INT $pid
    wait $pid || true
}
measure "first start"
measure "later start"
measure "later start"
