#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server, the peers of `kvserve bench latency --peer llama-cpp`
# and `kvserve bench serve --peer-url`, from the llama.cpp sources inside the llama-cpp-python sdist
# (PyPI is reachable where GitHub may not be). Not run by CI: about 20 minutes of both cores on a 2-core CPU.
#
# Usage: scripts/build_llama_cpp.sh [PREFIX]     (default PREFIX: ~/.cache/kvserve/llama.cpp)
# Result: PREFIX/bin/llama-bench and PREFIX/bin/llama-server, e.g.
#   kvserve bench latency --peer llama-cpp --llama-bench ~/.cache/kvserve/llama.cpp/bin/llama-bench
#   ~/.cache/kvserve/llama.cpp/bin/llama-server -m <gguf> -t 2 -np 32 -c 16384 --port 8081
# Environment: LLAMA_CPP_PYTHON_VERSION (pin the sdist, e.g. 0.3.36), JOBS (parallel build jobs, default: nproc),
# LLAMA_CPP_CMAKE_ARGS (more CMake flags, after the defaults). On an Intel host whose AMX the hypervisor does not
# hand over (llama-bench then dies with SIGSEGV in ggml_backend_amx_mul_mat), build for its AVX-512 without AMX:
#   LLAMA_CPP_CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
#   -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON'
set -euo pipefail

PREFIX="${1:-$HOME/.cache/kvserve/llama.cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"
JOBS="${JOBS:-$(nproc)}"

for tool in cmake python3 tar; do
    command -v "$tool" >/dev/null || { echo "error: $tool is required" >&2; exit 1; }
done
command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null || {
    echo "error: a C++ compiler is required (e.g. apt-get install build-essential)" >&2; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

spec="llama-cpp-python${VERSION:+==$VERSION}"
echo "downloading the $spec sdist ..."
python3 -m pip download --no-deps --no-binary :all: --dest "$WORK" "$spec"
sdist="$(find "$WORK" -maxdepth 1 \( -name 'llama_cpp_python-*.tar.gz' -o -name 'llama-cpp-python-*.tar.gz' \) | head -n 1)"
[ -n "$sdist" ] || { echo "error: no llama-cpp-python sdist was downloaded into $WORK" >&2; exit 1; }
tar -xzf "$sdist" -C "$WORK"

# The sdist vendors llama.cpp under vendor/llama.cpp.
src="$(find "$WORK" -maxdepth 3 -type d -path '*/vendor/llama.cpp' | head -n 1)"
[ -n "$src" ] && [ -f "$src/CMakeLists.txt" ] || { echo "error: vendor/llama.cpp not found in $sdist" >&2; exit 1; }
echo "building llama.cpp from $src with $JOBS jobs ..."

cmake -S "$src" -B "$WORK/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DBUILD_SHARED_LIBS=OFF \
    ${LLAMA_CPP_CMAKE_ARGS:-}
cmake --build "$WORK/build" --config Release -j "$JOBS" --target llama-bench llama-server

mkdir -p "$PREFIX/bin"
for bin in llama-bench llama-server; do
    found="$(find "$WORK/build" -type f -name "$bin" -perm -u+x | head -n 1)"
    [ -n "$found" ] || { echo "error: $bin was not built" >&2; exit 1; }
    install -m 0755 "$found" "$PREFIX/bin/$bin"
done
echo "installed: $PREFIX/bin/llama-bench $PREFIX/bin/llama-server"
"$PREFIX/bin/llama-bench" --help >/dev/null 2>&1 && echo "llama-bench runs"
