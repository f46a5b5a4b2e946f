#!/usr/bin/env bash
# The llama.cpp baseline's environment, .venv-llamacpp at the repository root (`make llama-cpp-env`).
#
#   bash projects/09_engine/llama_cpp_env.sh          (LLAMA_CPP_AVX2=1: also the AVX2 build of the tools)
#
# Two parts: llama-cpp-python (for our runner, kernel_lab/bench/llama_cpp.py, and the agreement checks), then
# llama.cpp's own llama-bench, llama-batched-bench and llama-server from the same pinned source
# (llama_cpp_tools.sh, about 20 minutes on a 2-core VM the first time). Each part skips itself when up to date.
#
# llama-cpp-python is compiled from source for this machine's CPU (GGML_NATIVE: AVX2/AVX-512/VNNI as the
# compiler finds them), with ggml's AMX backend off (the CMake switches and -mno-amx-*): on machines whose CPU
# flags advertise AMX but cannot run it (some virtual machines) that backend crashes in ggml_backend_amx_mul_mat. The environment holds
# only llama_cpp and numpy: the runner, kernel_lab/bench/llama_cpp.py, imports nothing else (not torch,
# not this repository's dependencies). It is rebuilt only when the requirement list, the CMake flags or
# this script change (a stamp file keyed on them). From scratch the build takes about 5 minutes on 2 cores.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${LLAMACPP_VENV:-$REPO/.venv-llamacpp}
REQUIREMENTS=$HERE/requirements-llamacpp.txt
CMAKE_FLAGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
CMAKE_FLAGS+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"
# The GGML_AMX_* switches do not reach a GGML_NATIVE build: -march=native defines __AMX_INT8__ on such CPUs
# and ggml compiles its AMX path from that macro (seen: the bundled model's first llama_decode crashed in
# ggml_backend_amx_mul_mat). GCC and Clang let explicit -mno-* flags win over -march=native in any order.
NO_AMX=""
if echo | ${CC:-cc} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -x c -E - >/dev/null 2>&1; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
KEY=$( (cat "$REQUIREMENTS" "${BASH_SOURCE[0]}"; echo "$CMAKE_FLAGS $NO_AMX") | sha1sum | cut -c1-12)
STAMP=$VENV/.installed-$KEY

build_python_env() {
echo "== building $VENV (requirements or flags changed, or first run)"
start=$SECONDS
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"; }
# Build-time tools for the source build (scikit-build-core runs CMake; a system cmake >= 3.21 also works).
pip_install --quiet --upgrade pip
# A stamp for other flags means a rebuild, which pip skips while the same version is installed; until it
# is done no stamp says the environment is ready.
rm -f "$VENV"/.installed-*
"$VENV/bin/python" -m pip uninstall --yes --quiet llama-cpp-python 2>/dev/null || true
CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} FORCE_CMAKE=1 \
  pip_install --no-cache-dir --no-binary llama-cpp-python -r "$REQUIREMENTS"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
touch "$STAMP"
echo "== $VENV ready after $((SECONDS - start)) s"
}

if [ -f "$STAMP" ]; then
  echo "== $VENV is up to date ($STAMP)"
else
  build_python_env
fi
LLAMACPP_VENV=$VENV bash "$HERE/llama_cpp_tools.sh" native
if [ "${LLAMA_CPP_AVX2:-0}" = 1 ]; then
  LLAMACPP_VENV=$VENV bash "$HERE/llama_cpp_tools.sh" avx2
fi
