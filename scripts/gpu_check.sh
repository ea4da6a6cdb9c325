#!/usr/bin/env bash
# The one command the device tool runs for issue #20's GPU proof: scripts/gpu_check.py on CUDA, kvserve from this
# source tree (PYTHONPATH; a pip install would ask for torch 2.13), the JSON report and the log in $OUT.
# Nothing is installed: the engine path needs only torch, transformers and transformers' own dependencies (the
# report's import_audit section checks it). Extra arguments go to gpu_check.py (e.g. --models llama31_8b).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
# The report's own budget (270 s) ends the run; the hard limit only stops a hang, under five minutes in all.
timeout -k 5 "${GPU_CHECK_TIMEOUT_S:-295}" python scripts/gpu_check.py --device cuda --out "$out/gpu_check.json" "$@" \
    2> "$out/gpu_check.log" | tee "$out/gpu_check.out"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "gpu_check.py exited with $rc; the log's tail:"
    tail -n 40 "$out/gpu_check.log"
fi
# The tables for docs/BENCHMARKS.md, from whatever the report holds (it is complete up to its last section).
if [ -f "$out/gpu_check.json" ]; then
    python scripts/gpu_check_markdown.py "$out/gpu_check.json" | tee "$out/gpu_check.md"
fi
exit "$rc"
