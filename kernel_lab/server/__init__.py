"""OpenAI-compatible server around kernel_lab.engine: app.py (the app, assembled from one module per endpoint:
serving_completion.py, serving_chat.py, over serving.py and logprobs.py), protocol.py (schemas and errors),
async_engine.py (the engine thread), metrics.py, launch.py (`kernel-lab serve`). Its benchmark lives in
kernel_lab.bench.
"""
