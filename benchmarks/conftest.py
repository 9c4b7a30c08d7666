"""Benchmarks run where the tests run: on a GPU natively, elsewhere under the Triton interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
