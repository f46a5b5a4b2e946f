"""Benchmarks and their figures, kept out of the core: they import transformers, vllm and the harness,
which kernel_lab.engine, models and ops never do.

    throughput.py   `kernel-lab bench throughput`: offline, this engine vs transformers vs vLLM
    serve.py        `kernel-lab bench serve`: online, against any OpenAI-compatible server
    plots.py        figures and tables drawn from bench serve's JSON records
"""
