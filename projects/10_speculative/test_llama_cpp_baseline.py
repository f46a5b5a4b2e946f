"""The llama.cpp speculative baseline's command lines and its parser of the examples' closing summary
(kernel_lab/bench/llama_cpp_tools.py); the benchmark itself (llama_cpp_baseline.py) needs the built tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_lab.bench import llama_cpp_tools

SUMMARY = """
0.01.000.000 I encoded  320 tokens in    1.031 seconds, speed:  310.3 t/s
0.01.000.001 I decoded  197 tokens in    1.633 seconds, speed:  120.6 t/s
0.01.000.002 I
0.01.000.003 I n_draft      = 4
0.01.000.004 I n_predict    = 197
0.01.000.005 I n_drafted    = 180
0.01.000.006 I t_draft_flat = 0.01 ms
0.01.000.007 I n_accept     = 113
0.01.000.008 I accept       = 62.778%
"""


def test_parse_speculation_reads_the_summary():
    assert llama_cpp_tools.parse_speculation(SUMMARY) == {
        "prompt_tokens": 320, "prompt_s": 1.031, "tokens": 197, "decode_s": 1.633, "drafted": 180, "accepted": 113}
    # llama-speculative's spacing ("n_accept  = 9")
    got = llama_cpp_tools.parse_speculation(SUMMARY.replace("n_accept     =", "n_accept  ="))
    assert got["accepted"] == 113


def test_parse_speculation_names_what_is_missing():
    with pytest.raises(ValueError, match="decoded"):
        llama_cpp_tools.parse_speculation(SUMMARY.replace("decoded", "skipped"))


def test_speculation_commands():
    lookup = llama_cpp_tools.speculation_command(Path("bin/llama-lookup"), Path("m.gguf"), Path("p.txt"), 192, 2, 4)
    assert lookup[:3] == ["bin/llama-lookup", "-m", "m.gguf"] and "-md" not in lookup
    assert lookup[lookup.index("--spec-draft-n-max") + 1] == "4" and lookup[lookup.index("-fa") + 1] == "off"
    assert lookup[lookup.index("--temp") + 1] == "0" and lookup[lookup.index("-n") + 1] == "192"
    spec = llama_cpp_tools.speculation_command(Path("bin/llama-speculative"), Path("t.gguf"), Path("p.txt"), 64, 1,
                                               3, draft_model=Path("d.gguf"))
    assert spec[spec.index("-md") + 1] == "d.gguf"
    with pytest.raises(ValueError, match="draft_max"):
        llama_cpp_tools.speculation_command(Path("x"), Path("m"), Path("p"), 8, 1, -1)
