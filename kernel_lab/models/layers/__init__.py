"""The building blocks of the decoders, one job per file: rotary.py (RoPE), linear.py (the projection
layouts). A Llama-shaped architecture composes them (llama.py)."""
