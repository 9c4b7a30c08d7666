"""Test set-up: kernels run under the Triton interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, hence at the very top of conftest.

One torch thread a process: the suite runs as pytest-xdist workers, one a core (``-n auto``), and
many tests spawn more processes (gloo ranks, the GPU suite's smoke run), so torch's default of one
OpenMP thread a core oversubscribes the machine. Every parallel region then waits for its other
threads to be scheduled: on a 2-core CI a decode step's small einsums took ~5 ms each instead of
~0.1 ms (the TP decoder and split-attention tests ran 10-25 times slower in the suite than alone).
Set before torch is imported, the variable also reaches every process the tests spawn. Results do
not depend on it: every bit-exact comparison runs both sides in processes of the same setting.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
