"""The critical-path counter counts what a GPU would issue: one operation per load, store or atomic,
masked or not, per program, and a launch lasts as long as its busiest program."""

from __future__ import annotations

import pytest
import torch

from ulakv.kernels._triton import INTERPRETED, tl, triton
from ulakv.kernels.critical_path import count_memory_ops, critical_path

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="counting runs under the Triton interpreter")


@triton.jit
def _one_of_each(x_ptr, BLOCK: tl.constexpr):
    """Program p: an unmasked scalar load and store, a masked vector load and store, an atomic; and
    program 0 one scalar store more."""
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + pid, tl.load(x_ptr + pid) + 1)
    tl.store(x_ptr + 8 + i, tl.load(x_ptr + 8 + i, mask=i < 3, other=0), mask=i < 3)
    tl.atomic_add(x_ptr + 7, 1, sem="relaxed")
    if pid == 0:
        tl.store(x_ptr + 6, 5)


def test_each_memory_operation_counts_once_and_the_busiest_program_sets_the_length() -> None:
    x = torch.zeros(16, dtype=torch.int64)
    with count_memory_ops() as launches:
        _one_of_each[(3,)](x, BLOCK=4)
        _one_of_each[(2,)](x, BLOCK=4)
    assert [launch.kernel for launch in launches] == ["_one_of_each", "_one_of_each"]
    assert launches[0].per_program == {(0, 0, 0): 6, (1, 0, 0): 5, (2, 0, 0): 5}
    assert [launch.busiest for launch in launches] == [6, 6]
    assert critical_path(launches) == 12
    assert launches[0].atomic_lanes == {x.data_ptr() + 7 * 8: 3}
    assert int(x[7]) == 5 and x[:3].tolist() == [2, 2, 1]  # the kernels still ran
