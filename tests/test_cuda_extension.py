"""kernel_lab.ops.cuda_extension's decisions on CPU, with fakes for the GPU and the tools: a cached build is
imported without ninja (or any compiler) in a new process, a missing tool is named in one line before any
build starts and is not re-checked by every later call, and the build runs only when a tool set is whole."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from kernel_lab.ops import cuda_extension as ce

ROOT = Path(__file__).resolve().parents[1]
MODULE_SOURCE = textwrap.dedent("""
    #include <Python.h>
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%s", NULL, -1, NULL};
    PyMODINIT_FUNC PyInit_%s(void) {
        PyObject *m = PyModule_Create(&def);
        if (m) PyModule_AddIntConstant(m, "answer", 42);
        return m;
    }
""")


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """An sm_89 GPU with torch built for CUDA 13.0, the build cache under tmp_path, and a full tool set that each
    test takes parts away from. Returns (calls to torch's builder, the tool-check counter, settable tools)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("KERNEL_LAB_BUILD_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(ce.UNAVAILABLE_ENV, raising=False)
    monkeypatch.setattr(ce, "_loaded", {})
    ce.unavailable_reason.cache_clear()
    tools = {"ninja": True, "nvcc": "/opt/cuda/bin/nvcc", "release": "13.0", "cxx": "/usr/bin/g++"}
    checks = []

    def facts(nvcc):
        checks.append(nvcc)
        return tools["release"], {75, 80, 89, 90}

    monkeypatch.setattr(torch.utils.cpp_extension, "is_ninja_available", lambda: tools["ninja"])
    monkeypatch.setattr(ce, "find_nvcc", lambda: tools["nvcc"])
    monkeypatch.setattr(ce, "nvcc_facts", facts)
    monkeypatch.setattr(ce, "find_cxx", lambda: tools["cxx"])
    builds = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: builds.append(kw) or "built module")
    yield builds, checks, tools
    ce.unavailable_reason.cache_clear()


def build_cached_module(name: str, build_dir: Path) -> Path:
    """A real extension module at the path a finished build leaves (plain CPython C, built with cc)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to build a stand-in extension module")
    build_dir.mkdir(parents=True, exist_ok=True)
    source = build_dir / "stand_in.c"
    source.write_text(MODULE_SOURCE % (name, name))
    library = build_dir / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(library)],
                   check=True, capture_output=True, timeout=60)
    return library


def test_a_cached_build_is_imported_without_any_build_tool(machine):
    builds, checks, tools = machine
    tools.update(ninja=False, nvcc=None, cxx=None)
    name, build_dir = ce.build_location((8, 9))
    build_cached_module(name, build_dir)
    assert ce.unavailable_reason() is None
    module = ce.load_extension()
    assert module.answer == 42 and module.__name__ == name
    assert builds == [] and checks == []  # neither torch's builder (which checks for ninja) nor the tool check ran


def test_a_missing_tool_is_one_line_naming_it_and_is_not_rechecked(machine):
    builds, checks, tools = machine
    tools.update(ninja=False, cxx=None)
    reason = ce.unavailable_reason()
    assert "\n" not in reason and "ninja" in reason and "C++ compiler (g++)" in reason
    for _ in range(3):
        with pytest.raises(ce.ExtensionUnavailable) as exc:
            ce.load_extension()
        assert str(exc.value) == reason
    assert builds == [] and len(checks) == 2  # once for the reason, once for the first load; later loads re-raise


def test_an_nvcc_of_another_major_version_is_named_with_both_versions(machine):
    builds, _, tools = machine
    tools["release"] = "12.4"
    reason = ce.unavailable_reason()
    assert "CUDA 12.4" in reason and "CUDA 13.0" in reason and "\n" not in reason
    with pytest.raises(ce.ExtensionUnavailable):
        ce.load_extension()
    assert builds == []


def test_with_every_tool_the_build_runs_for_this_gpu_into_the_cache(machine):
    builds, _, _ = machine
    assert ce.unavailable_reason() is None
    assert ce.load_extension() == "built module" and ce.load_extension() == "built module"
    (build,) = builds  # built once per process
    name, build_dir = ce.build_location((8, 9))
    assert build["name"] == name and build["build_directory"] == str(build_dir) and name.endswith("_sm89")


def test_a_cached_library_that_does_not_import_is_removed_and_rebuilt(machine):
    builds, _, _ = machine
    name, build_dir = ce.build_location((8, 9))
    build_dir.mkdir(parents=True)
    (build_dir / f"{name}.so").write_bytes(b"not an ELF file")
    with pytest.warns(RuntimeWarning, match="does not import"):
        assert ce.load_extension() == "built module"
    assert not (build_dir / f"{name}.so").exists() and len(builds) == 1


def test_a_failed_build_named_by_the_suite_is_not_rebuilt(machine, monkeypatch):
    builds, checks, _ = machine
    monkeypatch.setenv(ce.UNAVAILABLE_ENV, "extension build failed (rc 1, logs/build_extension.log)")
    assert ce.unavailable_reason() == "extension build failed (rc 1, logs/build_extension.log)"
    with pytest.raises(ce.ExtensionUnavailable, match="rc 1"):
        ce.load_extension()
    assert builds == [] and checks == []


def test_the_cache_key_follows_torch(machine, monkeypatch):
    first, _ = ce.build_location((8, 9))
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert ce.build_location((8, 9))[0] != first


def test_the_build_command_exits_3_with_one_line_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "kernel_lab.ops.cuda_extension"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == ce.TOOLS_MISSING_EXIT, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("the kernel_lab CUDA extension needs a CUDA device")
