"""Mistral: the Llama decoder with a sliding window over every layer (`sliding_window` in config.json),
which the paged decode kernels and the prefill mask apply (attention.py)."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    family_name = "Mistral"
    family_notes = "sliding-window attention on every layer (decode kernels and prefill mask, CPU and CUDA)"
    family_test = "test_families.py::test_family_matches_transformers[mistral_window]"
