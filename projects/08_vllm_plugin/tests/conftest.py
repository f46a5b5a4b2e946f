"""The plugin suite runs in `.venv-vllm` (run_tests.sh). In an environment without vLLM or without the
plugin installed (the repository's main `.venv`, the GPU image) these files are not collected at all."""

import importlib.util

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("kernel_lab_vllm_plugin") is None:
    collect_ignore_glob = ["test_*.py"]
