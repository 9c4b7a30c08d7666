"""Import triton so that kernels run everywhere: on a GPU natively, elsewhere under the interpreter.

Triton reads TRITON_INTERPRET once, when it is first imported. On a machine without CUDA we set it
before that import, so ``device="cpu"`` pools work out of the box; set TRITON_INTERPRET yourself to
override. Every kernel module imports ``triton`` and ``tl`` from here.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["INTERPRETED", "tl", "triton"]
