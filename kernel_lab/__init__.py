"""LLM Serving Kernels: a laboratory of GPU kernels for LLM serving.

`kernel_lab.harness` measures and checks; `kernel_lab.ops` holds the kernels behind one dispatch rule;
`kernel_lab.models`, `kernel_lab.engine` and `kernel_lab.server` assemble them into a serving engine.
"""

__version__ = "0.1.0"
