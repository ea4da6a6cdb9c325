#!/usr/bin/env bash
# `kvserve bench serve` against llama.cpp's llama-server on the default GGUF, both started here, with the same
# client; then the peak RSS (VmHWM) of the kvserve server. The figures of BENCHMARKS.md's serving section.
# Not run by CI. Needs llama-server from scripts/build_llama_cpp.sh.
# Usage: scripts/serve_vs_llama_server.sh [extra `kvserve bench serve` flags, e.g. --repeats 3 --json F --plot F]
# KVSERVE_SERVE_FLAGS: extra `kvserve serve` flags, e.g. KVSERVE_SERVE_FLAGS='--activation-quantization int8'
set -euo pipefail
LLAMA_SERVER="${LLAMA_SERVER:-$HOME/.cache/kvserve/llama.cpp/bin/llama-server}"
GGUF="$(python -c 'from kvserve.model.source import default_model_path; print(default_model_path())')"
# shellcheck disable=SC2086
kvserve serve --port 8000 --kv-cache-memory-bytes 1GiB ${KVSERVE_SERVE_FLAGS:-} > /tmp/kvserve-serve.log 2>&1 &
KV=$!
"$LLAMA_SERVER" -m "$GGUF" -t 2 -np 32 -c 16384 --port 8081 > /tmp/llama-server.log 2>&1 &
LL=$!
trap 'kill -INT $KV $LL 2>/dev/null; wait $KV $LL 2>/dev/null || true' EXIT
until curl -sf localhost:8000/health >/dev/null && curl -sf localhost:8081/health >/dev/null; do sleep 1; done
kvserve bench serve --url http://127.0.0.1:8000 --peer-url http://127.0.0.1:8081 "$@"
echo "kvserve serve peak RSS: $(awk '/VmHWM/ {printf "%.2f GiB", $2 / 1048576}' /proc/$KV/status)"
