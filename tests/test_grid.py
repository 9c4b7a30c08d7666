"""How many programs a persistent grid launches: the SMs times the programs of the kernel an SM
holds, from its sm_90 footprint, or, on a GPU, from the variants Triton compiled there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulakv.kernels import grid


@pytest.fixture(autouse=True)
def fresh_learning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grid, "_LEARNT", {})
    monkeypatch.setattr(grid, "_SEEN", set())


@pytest.mark.parametrize(
    ("registers", "warps", "shared", "held"),
    [(128, 16, 8192, 1), (64, 8, 32, 4), (80, 8, 4096, 3), (72, 4, 2048, 7), (32, 4, 0, 16), (16, 1, 0, 32)],
    ids=["classify", "apply-prepare", "apply-one-plan", "decide", "mark-live", "program-bound"],
)
def test_resident_programs_follow_registers_warps_and_the_program_bound(
    registers, warps, shared, held
) -> None:
    """Hopper: 256 registers a warp's allocation unit in 4 sub-partitions of 16,384, 64 warps, 32
    programs, 228 KiB of shared memory with 1 KiB reserved a program."""
    assert grid.resident_programs(registers, warps, shared) == held
    assert grid.resident_programs(32, 4, 57 * 1024) == 3  # (57 + 1) KiB a program: shared bounds it


def test_a_gpu_launch_teaches_the_grid_its_own_registers() -> None:
    """The sm_90 table sizes apply's workers at 3 an SM until a launch on a GPU reports what its
    Triton compiled: 200 registers at 8 warps holds 1 an SM, and the grid follows the fewest of
    the variants seen, never more again."""
    cpu = torch.device("cpu")  # (the H200's 132 SMs off a GPU)
    assert grid.program_slots(cpu, "apply_kernel") == 132 * 3
    heavy = SimpleNamespace(n_regs=200, metadata=SimpleNamespace(num_warps=8, shared=32))
    light = SimpleNamespace(n_regs=40, metadata=SimpleNamespace(num_warps=8, shared=32))
    grid.learn("apply_kernel", heavy)
    grid.learn("apply_kernel", light)
    assert grid.program_slots(cpu, "apply_kernel") == 132
    assert grid.program_slots(cpu, "classify_kernel") == 132  # another kernel keeps its table figure
    grid.learn("decide_kernel", None)  # the interpreter's launches return nothing to learn from
    assert grid.programs_per_sm("decide_kernel") == 7
