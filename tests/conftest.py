"""Test-session setup shared by every test file.

Triton decides between compiled and interpreted kernels when it is first imported (it wraps its language
helpers then), so on a machine without a CUDA GPU the interpreter must be on before any test module
imports triton. Tests that need it off (e.g. checking that TRITON is refused on CPU) unset it themselves.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
