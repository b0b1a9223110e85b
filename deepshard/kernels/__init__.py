"""CUDA kernels compiled with CuPy, each with a torch reference (see DESIGN.md "Kernels").

A leaf package: it may import torch and, when present, CuPy, and nothing else of deepshard.
"""
