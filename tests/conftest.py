"""Test set-up: kernels run under the Triton interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, hence at the very top of conftest.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def device() -> str:
    """The device pools are built on: cuda when present, else cpu (kernels interpreted)."""
    return "cuda" if torch.cuda.is_available() else "cpu"
