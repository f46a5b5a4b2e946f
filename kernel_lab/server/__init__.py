"""OpenAI-compatible server around kernel_lab.engine (openai_api.py, async_engine.py, metrics.py) and the
online serving benchmark (bench_serve.py, plots.py).

Entry points: `kernel-lab serve` and `kernel-lab bench serve`.
"""
