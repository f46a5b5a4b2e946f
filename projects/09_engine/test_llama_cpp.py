"""The llama.cpp baseline's batching loop (kernel_lab/bench/llama_cpp.py), driven by a fake `llama_cpp` module
that checks every batch it is given; and, when .venv-llamacpp exists, one tiny run of the real thing."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernel_lab.bench.llama_cpp import LlamaCpp, llama_cpp_greedy, run_workload

REPO = Path(__file__).resolve().parents[2]
LLAMACPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
LLAMACPP_READY = any((REPO / ".venv-llamacpp").glob(".installed-*"))  # llama_cpp_env.sh's stamp: build finished
VOCAB = 53


def intended(history: list[int]) -> int:
    return (sum(history) * 31 + len(history)) % VOCAB


def greedy_next(history: list[int]) -> int:
    """The fake's logits peak at two tokens (a tie); greedy must take the lower index."""
    a = intended(history)
    return min(a, (a + 7) % VOCAB)


def reference(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(greedy_next(prompt + out))
    return out


class FakeBatch:
    def __init__(self, n: int):
        self.capacity, self.n_tokens = n, 0
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [0] * n
        self.seq_id = [[0] for _ in range(n)]


class FakeLlamaCpp:
    """Just enough of llama_cpp's C API: a per-sequence KV history that must grow one position at a time,
    logits that depend on the whole history, and a log of every batch and every freed sequence."""

    __version__ = "0.0-fake"

    def __init__(self):
        self.kv: dict[int, list[int]] = {}
        self.batches: list[list[tuple[int, int, int, int]]] = []
        self.freed: list[tuple[int, list[int]]] = []  # (sequence id, its history when freed)
        self.rows: dict[int, ctypes.Array] = {}
        self.closed = []

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        assert isinstance(path, bytes)
        return "model"

    def llama_context_default_params(self):
        return SimpleNamespace()

    def llama_init_from_model(self, model, params):
        self.cparams = params
        return "ctx"

    def llama_model_get_vocab(self, model):
        return "vocab"

    def llama_vocab_n_tokens(self, vocab):
        return VOCAB

    def llama_batch_init(self, n_tokens, embd, n_seq_max):
        assert embd == 0 and n_seq_max == 1
        return FakeBatch(n_tokens)

    def llama_get_memory(self, ctx):
        return "memory"

    def llama_memory_seq_rm(self, mem, seq, p0, p1):
        assert (mem, p0, p1) == ("memory", -1, -1)
        self.freed.append((seq, self.kv.pop(seq, [])))
        return True

    def llama_decode(self, ctx, batch):
        n = batch.n_tokens
        assert 0 < n <= min(batch.capacity, self.cparams.n_batch)
        entries = [(batch.token[i], batch.pos[i], batch.seq_id[i][0], batch.logits[i]) for i in range(n)]
        assert all(batch.n_seq_id[i] == 1 for i in range(n))
        self.batches.append(entries)
        self.rows = {}
        for i, (token, pos, seq, logits) in enumerate(entries):
            assert 0 <= seq < self.cparams.n_seq_max
            assert 0 <= token < VOCAB
            history = self.kv.setdefault(seq, [])
            assert pos == len(history), f"sequence {seq}: position {pos} after {len(history)} cells"
            history.append(token)
            if logits:
                row = (ctypes.c_float * VOCAB)(*([0.0] * VOCAB))
                a = intended(history)
                row[a] = row[(a + 7) % VOCAB] = 5.0
                self.rows[i] = row
        return 0

    def llama_get_logits_ith(self, ctx, i):
        return ctypes.cast(self.rows[i], ctypes.POINTER(ctypes.c_float))  # KeyError: no logits were asked for

    def llama_print_system_info(self):
        return b"CPU : FAKE = 1 |"

    def llama_batch_free(self, batch):
        self.closed.append("batch")

    def llama_free(self, ctx):
        self.closed.append("ctx")

    def llama_model_free(self, model):
        self.closed.append("model")


def _workload():
    prompts = [[(7 * r + 3 * i) % VOCAB for i in range(3 + 2 * r)] for r in range(7)]
    return prompts, [1, 4, 6, 2, 5, 3, 4]


def test_outputs_are_greedy_exact_and_prompts_fed_exactly():
    fake = FakeLlamaCpp()
    prompts, lens = _workload()
    with LlamaCpp("m.gguf", concurrency=3, max_len=32, threads=2, n_batch=8, lib=fake) as llm:
        assert llm.n_batch == 8
        outputs = llm.generate(prompts, lens)
    assert [len(o) for o in outputs] == lens
    assert outputs == [reference(p, n) for p, n in zip(prompts, lens)]
    # Every request ran in one sequence that was freed when it finished, holding exactly its prompt and all
    # outputs but the last (which is never fed back).
    assert sorted(tuple(h) for _, h in fake.freed) == sorted(tuple(p + o[:-1]) for p, o in zip(prompts, outputs))
    assert fake.kv == {}
    assert fake.closed == ["batch", "ctx", "model"]
    c = fake.cparams
    assert (c.n_seq_max, c.n_threads, c.n_threads_batch, c.n_batch) == (3, 2, 2, 8)
    assert c.n_ctx >= 3 * 32 and c.n_ctx % 3 == 0


def test_sequence_ids_are_freed_and_reused_and_batches_are_well_formed():
    fake = FakeLlamaCpp()
    prompts, lens = _workload()
    prefill_calls: list[int] = []  # indices into fake.batches of the prompt (prefill) batches
    with LlamaCpp("m.gguf", concurrency=3, max_len=32, threads=1, n_batch=8, lib=fake) as llm:
        prefill = llm._prefill

        def tagged(*args):
            prefill_calls.append(len(fake.batches))
            prefill(*args)

        llm._prefill = tagged
        llm.generate(prompts, lens)
    # 7 requests through 3 sequence ids: every id is used, and ids come back after being freed.
    assert len(fake.freed) == 7
    assert {s for s, _ in fake.freed} == {0, 1, 2}
    prefills = [b for i, b in enumerate(fake.batches) if i in prefill_calls]
    steps = [b for i, b in enumerate(fake.batches) if i not in prefill_calls]
    assert prefills and steps
    assert all(len(b) <= 8 for b in fake.batches)
    for b in steps:  # one token per active sequence, logits for each, never more than `concurrency`
        seqs = [e[2] for e in b]
        assert len(seqs) == len(set(seqs)) <= 3 and all(e[3] for e in b)
    # Requests 0-2 are admitted first; request 0 wants one token, which its prefill gives, so it is freed
    # at once and the first decode step runs sequences 1 and 2 together; request 3 then takes sequence 0.
    assert sorted(e[2] for e in steps[0]) == [1, 2]
    assert fake.freed[0] == (0, prompts[0])
    assert [s for s, h in fake.freed if h[: len(prompts[3])] == prompts[3]] == [0]
    # Prefill asks for logits once per request: at its prompt's last position.
    assert sorted(e[1] for b in prefills for e in b if e[3]) == sorted(len(p) - 1 for p in prompts)
    # Tokens fed: every prompt token once (in prefill), plus every output but the last (in decode steps).
    assert sum(len(b) for b in prefills) == sum(len(p) for p in prompts)
    assert sum(len(b) for b in steps) == sum(n - 1 for n in lens)


def test_prompt_longer_than_n_batch_is_chunked():
    fake = FakeLlamaCpp()
    prompt = [(5 * i + 1) % VOCAB for i in range(20)]
    with LlamaCpp("m.gguf", concurrency=2, max_len=30, threads=1, n_batch=8, lib=fake) as llm:
        out = llm.generate([prompt], [3])
    assert out == [reference(prompt, 3)]
    assert [len(b) for b in fake.batches] == [8, 8, 4, 1, 1]
    assert [e[3] for b in fake.batches[:3] for e in b].count(1) == 1


def test_run_workload_and_greedy_helper():
    fake = FakeLlamaCpp()
    prompts, _ = _workload()
    result = run_workload("m.gguf", prompts[:4], 5, concurrency=2, threads=1, lib=fake)
    assert result["generated"] == 20 and result["prompt_tokens"] == sum(len(p) for p in prompts[:4])
    assert result["outputs"] == [reference(p, 5) for p in prompts[:4]]
    assert result["llama_cpp_python"] == "0.0-fake" and result["system_info"] == "CPU : FAKE = 1 |"
    assert result["elapsed_time"] > 0
    # The warm-up ran first, on the first prompt's first 8 tokens, and was freed like any request.
    assert fake.freed[0][1][: len(prompts[0][:8])] == prompts[0][:8]
    assert llama_cpp_greedy("m.gguf", prompts[:2], 3, threads=1, lib=FakeLlamaCpp()) == \
        [reference(p, 3) for p in prompts[:2]]


@pytest.mark.parametrize("prompts, lens", [([[1, 2]], [0]), ([[]], [2]), ([[1] * 30], [5]), ([[1]], [1, 2])])
def test_bad_requests_are_refused(prompts, lens):
    with LlamaCpp("m.gguf", concurrency=1, max_len=32, threads=1, lib=FakeLlamaCpp()) as llm:
        with pytest.raises(ValueError):
            llm.generate(prompts, lens)


def test_runner_imports_neither_torch_nor_the_engine():
    code = "import sys, kernel_lab.bench.llama_cpp; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'" \
           " or m.startswith('kernel_lab.') and m not in ('kernel_lab.bench', 'kernel_lab.bench.llama_cpp')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not LLAMACPP_READY, reason="no .venv-llamacpp (make llama-cpp-env)")
def test_real_llama_cpp_tiny_workload(tmp_path):
    from kernel_lab.models.gguf import default_model_path

    spec = {"model": str(default_model_path()), "prompts": [[504, 3458, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8, 9]],
            "output_len": [4, 6], "concurrency": 2, "threads": 1}
    (tmp_path / "in.json").write_text(json.dumps(spec))
    subprocess.run([str(LLAMACPP_PYTHON), "-m", "kernel_lab.bench.llama_cpp", str(tmp_path / "in.json"),
                    str(tmp_path / "out.json")], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   timeout=120)
    out = json.loads((tmp_path / "out.json").read_text())
    assert [len(o) for o in out["outputs"]] == [4, 6] and out["generated"] == 10
    assert all(0 <= t < 49152 for o in out["outputs"] for t in o)
    assert out["llama_cpp_python"] and "CPU" in out["system_info"]


def test_agreement_comparison():
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_cpp_agreement", Path(__file__).parent / "llama_cpp_agreement.py")
    agreement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agreement)
    assert agreement.cut_at_eos([5, 6, 2, 7, 2], {2}) == [5, 6, 2]
    assert agreement.cut_at_eos([5, 6], {2}) == [5, 6]
    same = agreement.compare([1, 2, 3], [1, 2, 3])
    assert same["exact"] and same["prefix_fraction"] == 1.0 and same["first_divergence"] is None
    diff = agreement.compare([1, 2, 3, 4], [1, 2, 9])
    assert not diff["exact"] and diff["common_prefix"] == 2 and diff["prefix_fraction"] == 0.5
    assert diff["first_divergence"] == 2
    assert agreement.compare([1, 2], [1, 2, 3])["prefix_fraction"] == pytest.approx(2 / 3)
    assert len(agreement.CHAT_PROMPTS) >= 16
