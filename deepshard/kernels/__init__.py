"""CUDA kernels compiled with CuPy, each with a torch reference (see DESIGN.md "Kernels").

A leaf package: it may import torch and, when present, CuPy, and nothing else of deepshard.
Importing the package itself stays torch-free (``ds_report`` reads :data:`REGISTRY`); each
op lives in its own module, ``deepshard.kernels.<op>``, with its reference implementation
(the CPU path and the test oracle) and a CUDA path used for CUDA tensors when CuPy is
installed.
"""

from __future__ import annotations

from deepshard.kernels.registry import REGISTRY, Op

__all__ = ["REGISTRY", "Op"]
