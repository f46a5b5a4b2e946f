"""OpenAI-compatible server around kernel_lab.engine: protocol.py (schemas and errors), openai_api.py (routes),
async_engine.py (the engine thread), metrics.py, launch.py (`kernel-lab serve`). Its benchmark lives in
kernel_lab.bench.
"""
