"""The critical-path counter counts what a GPU would issue: one operation per load, store or atomic,
masked or not, per program, and a launch lasts as long as its busiest program."""

from __future__ import annotations

import pytest
import torch

from tools.critical_path import count_memory_ops, critical_path
from ulakv.kernels._triton import INTERPRETED, tl, triton

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


def test_a_launch_of_more_programs_than_slots_runs_in_waves() -> None:
    """With program slots, a launch lasts its programs' operations shared by the slots (rounded up)
    when that is longer than its busiest program: 41 programs of 5-6 operations (206) on 4 slots
    take 52 steps; on 64 slots the busiest program's 6."""
    x = torch.zeros(64, dtype=torch.int64)
    with count_memory_ops() as launches:
        _one_of_each[(41,)](x, BLOCK=4)
    (launch,) = launches
    assert launch.total == 41 * 5 + 1
    assert launch.length() == launch.length(64) == 6
    assert launch.length(4) == 52
    assert critical_path(launches, slots=4) == 52


@pytest.mark.parametrize("policy", ["lru", "pblru"])
def test_a_release_walks_one_group_a_program(policy: str) -> None:
    """Groups share no release state, so a release runs a program per group, each walking the
    request's addresses once: the busiest program does not grow with the groups (one program
    walking every group took 1,648 operations for 20K tokens in 8 groups, now 206)."""
    from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered

    busiest = {}
    for groups in (1, 5):
        layout = Tiered(gpu_slots=8, cpu_slots=2100, policy=ExactLRU() if policy == "lru" else PBLRU(4))
        pool = Pool(
            PoolConfig(
                entry=EntrySpec(bytes_per_layer=4), num_layers=groups, layers_per_group=1, layout=layout
            )
        )
        seq = pool.admit(2100)  # three blocks of 1,024
        some = seq.addresses[:12]  # the GPU tier full, four rows on the CPU, in every group
        for layer in range(groups):
            pool.write(layer, some, torch.full((12, 4), layer, dtype=torch.uint8))
        with count_memory_ops() as launches:
            pool.release(seq)
        assert [(launch.kernel, launch.programs) for launch in launches] == [("release_kernel", groups)]
        busiest[groups] = launches[0].busiest
        pool.check_invariants()
        assert pool.stats()["live_addresses"] == 0
    assert busiest[5] == busiest[1] > 0, busiest


def test_an_engine_admit_marks_one_block_a_program() -> None:
    """An engine-owned pool's admit: one program checks the addresses, then a program per group and
    block marks them live, so no program's work grows with the groups (the check's program marking
    every group took 2,037 operations for 16K tokens in 61 groups, now 85 + 3)."""
    from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
    from ulakv.kernels import common as K

    counts = {}
    for groups in (1, 5):
        layout = Tiered(gpu_slots=8, cpu_slots=2100, policy=ExactLRU())
        cfg = PoolConfig(
            entry=EntrySpec(bytes_per_layer=4),
            num_layers=groups,
            layers_per_group=1,
            layout=layout,
            engine_addresses=2108,
        )
        pool = Pool(cfg)
        locs = torch.randperm(2108, generator=torch.Generator().manual_seed(groups))[:2100]
        with count_memory_ops() as launches:
            pool.admit_addresses(locs)
        counts[groups] = [(launch.kernel, launch.programs, launch.busiest) for launch in launches]
        assert pool.live_addresses().tolist() == sorted(locs.tolist())
        assert (
            pool.internals().state.mapping[:, locs] == int(K.M_UNHOMED)
        ).all()  # live, no home yet, every group
    check, mark = counts[5]
    assert counts[1] == [check, ("mark_live_kernel", 3, mark[2])]
    assert mark[:2] == ("mark_live_kernel", 5 * 3) and mark[2] < 5
