"""Measurement and checking harness. It knows nothing about the kernels it measures."""
