#!/usr/bin/env bash
# llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server, llama-lookup, llama-speculative),
# built from the very source the project pins: the llama-cpp-python sdist named in requirements-llamacpp.txt
# carries llama.cpp's tree (and its git metadata, so the binaries report the commit) under vendor/llama.cpp.
# `make llama-cpp-env` runs it.
#
#   bash projects/09_engine/llama_cpp_tools.sh [native|avx2]
#
# native: GGML_NATIVE=ON (what this CPU runs), AMX off as llama_cpp_env.sh does, into
#         .venv-llamacpp/llama.cpp/build/bin.
# avx2:   GGML_NATIVE=OFF with the Haswell set forced (SSE4.2, AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no
#         VNNI), into .venv-llamacpp/llama.cpp/build-avx2/bin: the AVX2 machine's build, runnable on an AVX-512
#         one. It builds only the two benchmark tools (llama-server is the slowest target and nothing here
#         compares servers per ISA).
# Each bin directory keeps the shared libraries the binaries find through their rpath, so it moves as one,
# and holds llama-cpp-build.json: the tool list, the llama.cpp commit, the CMake and compiler flags and this
# CPU's ISA flags, which the benchmark records copy. A build whose key (source version, flags, this script)
# matches that file is skipped. From scratch the native build took about 20 minutes on a shared 2-core VM.
set -euo pipefail

VARIANT=${1:-native}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${LLAMACPP_VENV:-$REPO/.venv-llamacpp}
REQUIREMENTS=$HERE/requirements-llamacpp.txt
VERSION=$(sed -n 's/^llama-cpp-python==\([^ ;]*\).*/\1/p' "$REQUIREMENTS")
[ -n "$VERSION" ] || { echo "no 'llama-cpp-python==VERSION' line in $REQUIREMENTS" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] && PYTHON=$VENV/bin/python

COMMON="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF"
AMX_OFF="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
case "$VARIANT" in
  native)
    BUILD=$VENV/llama.cpp/build
    CMAKE_FLAGS="$COMMON -DGGML_NATIVE=ON $AMX_OFF"
    # llama-lookup (prompt-lookup n-gram drafts) and llama-speculative (a draft model): project 10's baselines
    TARGETS="llama-bench llama-batched-bench llama-server llama-lookup llama-speculative"
    # As in llama_cpp_env.sh: -march=native defines __AMX_INT8__ where the flags advertise AMX, the CMake
    # switches do not reach that, and some virtual machines advertise AMX they cannot run.
    NO_AMX=""
    if echo | ${CC:-cc} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -x c -E - >/dev/null 2>&1; then
      NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
    ;;
  avx2)
    BUILD=$VENV/llama.cpp/build-avx2
    CMAKE_FLAGS="$COMMON -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON"
    CMAKE_FLAGS+=" -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF"
    CMAKE_FLAGS+=" -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF $AMX_OFF"
    TARGETS="llama-bench llama-batched-bench"
    NO_AMX=""
    ;;
  *) echo "usage: $0 [native|avx2]" >&2; exit 2 ;;
esac

KEY=$( (cat "${BASH_SOURCE[0]}"; echo "$VERSION $CMAKE_FLAGS $NO_AMX $TARGETS") | sha1sum | cut -c1-12)
INFO=$BUILD/bin/llama-cpp-build.json
if [ -f "$INFO" ] && grep -q "\"key\": \"$KEY\"" "$INFO"; then
  echo "== llama.cpp $VARIANT tools are up to date ($INFO)"
  exit 0
fi

SDIST_DIR=$VENV/llama-cpp-python-sdist
SRC_ROOT=$SDIST_DIR/llama_cpp_python-$VERSION
SRC=$SRC_ROOT/vendor/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  echo "== fetching the llama-cpp-python $VERSION sdist (llama.cpp's vendored tree)"
  mkdir -p "$SDIST_DIR"
  "$PYTHON" -m pip download --disable-pip-version-check --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
  tar xzf "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SDIST_DIR"
  rm "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
fi
COMMIT=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)

echo "== building llama.cpp $VARIANT tools ($TARGETS) at $COMMIT into $BUILD"
start=$SECONDS
# Until the build is done no info file says it is ready.
rm -f "$INFO"
# shellcheck disable=SC2086  # the flag lists are word lists
CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX" cmake -S "$SRC" -B "$BUILD" $CMAKE_FLAGS >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" --target $TARGETS

VARIANT="$VARIANT" KEY="$KEY" VERSION="$VERSION" COMMIT="$COMMIT" CMAKE_FLAGS="$CMAKE_FLAGS" \
  COMPILER_FLAGS="$NO_AMX" TARGETS="$TARGETS" INFO="$INFO" "$PYTHON" - <<'EOF'
import json, os, platform, time

flags = set()
model = platform.processor()
try:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            name, _, value = line.partition(":")
            if name.strip() == "flags":
                flags = set(value.split())
            elif name.strip() == "model name":
                model = value.strip()
except OSError:
    pass
isa = {name: name in flags for name in
       ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni",
        "amx_tile", "amx_int8", "amx_bf16")}
info = {
    "key": os.environ["KEY"],
    "variant": os.environ["VARIANT"],
    "tools": os.environ["TARGETS"].split(),
    "llama_cpp_python_version": os.environ["VERSION"],
    "llama_cpp_commit": os.environ["COMMIT"],
    "cmake_flags": os.environ["CMAKE_FLAGS"].split(),
    "compiler_flags": os.environ["COMPILER_FLAGS"].split(),
    "built_on_cpu": model,
    "built_on_cpu_isa": isa,
    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}
with open(os.environ["INFO"], "w") as out:
    json.dump(info, out, indent=1)
    out.write("\n")
EOF
echo "== llama.cpp $VARIANT tools ready after $((SECONDS - start)) s ($INFO)"
