"""Victim-search work as the pool grows 256x: PB-LRU's summary-guided search against a full scan.

    pytest benchmarks/test_victim_search.py --benchmark-only

``extra_info["words_read"]`` is the figure that matters (the device search counts every word it
loads); the timing is the interpreter's on a CPU machine, not a GPU figure.
"""

from __future__ import annotations

import pytest
import torch
from serial_search import bucket_bits, search

from ulakv.kernels.buckets import level_offsets

VICTIMS = 64
SIZES = [16 * 1024, 256 * 1024, 4 * 1024 * 1024]


@pytest.mark.parametrize("occupancy", [1.0, 0.01], ids=["every-slot", "1pct-slots"])
@pytest.mark.parametrize("slots", SIZES, ids=["16K", "256K", "4M"])
def test_pblru_victim_search_reads(benchmark, slots: int, occupancy: float) -> None:
    benchmark.group = "victim search, 64 victims"
    occupied = torch.rand(slots, generator=torch.Generator().manual_seed(0)) < occupancy
    words = bucket_bits(occupied)
    expected = torch.nonzero(occupied).flatten()[:VICTIMS]
    got, reads = benchmark.pedantic(
        lambda b: search(b, slots, VICTIMS), setup=lambda: ((words.clone(),), {}), rounds=3
    )
    assert torch.equal(got.long(), expected)
    levels = len(level_offsets(slots)) - 1
    # Work follows the summary levels: one step of 32 words per level, plus the victims' words.
    assert reads <= levels * 32 + VICTIMS + 1
    benchmark.extra_info.update(words_read=reads, levels=levels, scan_reads=slots)
