"""The ``Replicated(world)`` baseline's own number, by hand (``docs/design.md``, section 4, invariant 1).

Every one of ``world`` ranks holds every entry, so distinct entries / physical slots used is exactly
``1 / world``, every replica counted; the capacity is one replica's slots, not ``world`` times that;
a GPU-only replica moves no bytes. Traffic, release and bad input: ``tests/test_baseline_traffic.py``
and ``tests/test_bad_input.py``.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from helpers import random_rows, replicated_config

from ulakv import CapacityError, Pool


@pytest.mark.parametrize("world", [1, 3, 8], ids=["world1", "world3", "world8"])
def test_replicated_ratio_is_one_over_world(world: int) -> None:
    pool = Pool(replicated_config(world=world, gpu=13, bpl=20, layers=5, lpg=2))
    assert pool.capacity == 13, "capacity is one replica's slots, not world times that"
    a = pool.admit(num_tokens=7)
    b = pool.admit(num_tokens=6)
    with pytest.raises(CapacityError):
        pool.admit(num_tokens=1)
    for layer in range(5):  # a in every layer, b in the first group only
        pool.write(layer, a.addresses, random_rows(layer, 7, 20))
    pool.write(1, b.addresses[:4], random_rows(9, 4, 20))
    stats = pool.stats()
    homed = 3 * 7 + 4  # three groups of a, group 0 of four of b's
    assert stats["replicas"] == world
    assert stats["distinct_entries"] == stats["gpu_slots_used"] == homed
    assert stats["physical_slots_used"] == world * homed
    assert Fraction(stats["distinct_entries"], stats["physical_slots_used"]) == Fraction(1, world)
    assert stats["bytes_in"] == stats["bytes_out"] == 0, "a GPU-only replica moves nothing"
    sel = pool.prepare(
        2, torch.tensor([[*a.addresses[:3].tolist(), -1], [*b.addresses[:2].tolist(), -1, -1]])
    )
    stats = pool.stats()
    assert stats["hits"] == 3 and stats["misses"] == 2  # b had no home in group 2
    assert Fraction(stats["distinct_entries"], stats["physical_slots_used"]) == Fraction(1, world)
    assert torch.equal(pool.gpu_buffer(4)[sel.slots[0, :3].long()], random_rows(4, 7, 20)[:3])
    pool.release(a)
    pool.release(b)
    stats = pool.stats()
    assert stats["distinct_entries"] == stats["physical_slots_used"] == 0
