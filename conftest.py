"""Repository-wide pytest set-up.

Triton reads TRITON_INTERPRET when a kernel is *decorated*, so the switch must be made here, before any
`kernel_lab.ops` module is imported. On a machine without CUDA every Triton kernel then runs through the
interpreter on CPU tensors; on a GPU machine the variable is left alone and kernels compile for the device.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Mark compile-only tests; skip GPU tests without a GPU, and extension tests where it cannot be had; on a
    GPU, run the device's tests first.

    A test whose artifacts come from a fixture named `*compiled*` (Triton AOT or nvcc builds for sm_80/89/90,
    checked for spills and SASS) is `compile_only`: the GPU suite deselects those (`-m "not compile_only"`),
    since CI runs them. A `cuda_extension` test on a GPU machine where the extension is neither cached nor
    buildable is skipped with the one line that says which tool is missing."""
    compile_only = pytest.mark.compile_only
    for item in items:
        if any("compiled" in name for name in getattr(item, "fixturenames", ())):
            item.add_marker(compile_only)
    if not HAS_CUDA:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
        return
    # On a GPU the device's tests go first: the GPU suite's deadline cuts a project's run short, and the
    # CPU-only tests (the SIMT emulator, the C kernels, the references) are CI's to run anyway. Stable: the
    # order within each group is the files' own.
    items.sort(key=lambda item: 0 if "gpu" in item.keywords or "cuda_extension" in item.keywords
               else 1 if "device" in getattr(item, "fixturenames", ()) else 2)
    if any("cuda_extension" in item.keywords for item in items):
        from kernel_lab.ops.cuda_extension import unavailable_reason

        reason = unavailable_reason()
        if reason:
            for item in items:
                if "cuda_extension" in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    """The device a correctness test runs on: the GPU when present, else CPU through the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def isa_build():
    """build(library, isa): the C library `library` (kernel_lab/csrc/cpu) built for `isa` (one of
    kernel_lab.harness.testing.ISA_BUILDS; the narrower builds are forced with flags, so an AVX-512 machine
    tests the AVX2 and scalar paths too), or pytest.skip where it cannot be built here."""
    import platform

    from kernel_lab.ops import cpu_kernels

    def build(library: str, isa: str):
        if cpu_kernels.compiler() is None:
            pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")
        if isa != "native" and platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("the ISA variants are x86-64 builds")
        built = cpu_kernels.load_library(library, cpu_kernels.ISA_FLAGS[isa])
        assert built is not None, f"{library} did not build for {isa}"
        return built
    return build


@pytest.fixture
def reference_only(monkeypatch):
    """Make kernel_lab.ops take the PyTorch reference path on CPU (used by engine and server tests,
    where interpreting every kernel of a 30-layer model would take minutes)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


# tools/gpu_suite.sh sets KERNEL_LAB_TEST_LOG: each test's outcome is appended to it (JSON lines) as the test
# ends, so a run the suite's deadline interrupts or kills still reports which tests passed and failed.
_TEST_LOG = os.environ.get("KERNEL_LAB_TEST_LOG")


def pytest_runtest_logreport(report):
    if not _TEST_LOG or not (report.when == "call" or report.outcome != "passed"):
        return  # one line per test: its call, or the setup/teardown that failed or skipped it
    import json

    with open(_TEST_LOG, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "seconds": round(report.duration, 3)}) + "\n")


@pytest.fixture
def c_kernels_only(reference_only, monkeypatch):
    """CPU ops on their plain-C kernels (kernel_lab/csrc/cpu): no interpreter, KERNEL_LAB_CPU_KERNELS unset,
    skipped without a C compiler. Returns `forbid(module, *names)`, which makes those PyTorch references
    fail, so that a silent fallback to them cannot pass."""
    from kernel_lab.ops import cpu_kernels

    monkeypatch.delenv("KERNEL_LAB_CPU_KERNELS", raising=False)
    if cpu_kernels.compiler() is None:
        pytest.skip("no C compiler ($CC or cc on PATH) to build kernel_lab/csrc/cpu")

    def forbid(module, *names):
        def ran_the_reference(*args, **kwargs):
            raise AssertionError("a CPU op ran its PyTorch reference, not its C kernel")

        for name in names:
            monkeypatch.setattr(module, name, ran_the_reference)

    return forbid
