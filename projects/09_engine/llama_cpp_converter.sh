#!/usr/bin/env bash
# llama.cpp's Hugging Face -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its own gguf-py),
# unpacked from the llama-cpp-python source distribution that requirements-llamacpp.txt pins, into
# .llama-cpp-converter/ at the repository root (`make llama-cpp-converter`). test_families.py converts its tiny
# checkpoints with it, run by the main environment's Python (torch, transformers, numpy, safetensors).
#
#   bash projects/09_engine/llama_cpp_converter.sh                        # pip downloads the sdist
#   LLAMA_CPP_SDIST=llama_cpp_python-X.tar.gz bash projects/09_engine/llama_cpp_converter.sh   # or unpacks one
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${LLAMA_CPP_CONVERTER_DIR:-$REPO/.llama-cpp-converter}
VERSION=$(sed -n 's/^llama-cpp-python==//p' "$HERE/requirements-llamacpp.txt")
STAMP=$OUT/.llama-cpp-python-$VERSION
if [ -f "$STAMP" ]; then
  echo "== $OUT is up to date ($STAMP)"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
SDIST=${LLAMA_CPP_SDIST:-}
if [ -z "$SDIST" ]; then
  PY=${PYTHON:-$REPO/.venv/bin/python}
  [ -x "$PY" ] || PY=python3
  "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$TMP"
  SDIST=$(ls "$TMP"/llama_cpp_python-*.tar.gz)
fi
tar -xzf "$SDIST" -C "$TMP" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' \
  '*/vendor/llama.cpp/gguf-py/*'
rm -rf "$OUT"
mv "$TMP"/llama_cpp_python-*/vendor/llama.cpp "$OUT"
touch "$STAMP"
echo "== llama.cpp's converter (llama-cpp-python $VERSION) in $OUT"
