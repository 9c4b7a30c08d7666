"""The CPU tier's host memory (``ulakv.host_memory``): reserved as asked at real size, refused
before anything is mapped when the host cannot hold it, reads as zeros, and reported by stats()."""

from __future__ import annotations

import mmap

import pytest
import torch
from helpers import small_pool

from ulakv import host_memory
from ulakv.errors import CapacityError

GIB = 2**30


@pytest.mark.parametrize(
    ("name", "layers", "cpu_slots", "row_bytes"),
    [
        # GLM-5.3 and DeepSeek-V3.2 tiers beside a 1 M-slot GPU pool (656-B latent rows): a group of
        # 4 layers with 4 M CPU slots, one layer with 3 M, and an odd size (7 layers x 999,983 rows).
        ("glm5-4-layers-4M", 4, 4 * 2**20, 656),
        ("dsv32-1-layer-3M", 1, 3 * 2**20, 656),
        ("odd-7-layers", 7, 999_983, 656),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_real_tier_is_reserved_within_a_percent_of_what_was_asked(name, layers, cpu_slots, row_bytes):
    """The allocator's arithmetic on the tier's shape (rows + the padding row): the map reserves
    whole pages (under a page more), where the pinned caching allocator reserves the next power of
    two (up to 2x: 4 layers x 4 M rows asks 10.25 GiB and would take 16)."""
    asked = layers * (cpu_slots + 1) * row_bytes
    reserved = host_memory.reserved_bytes(asked)
    assert asked <= reserved < asked + mmap.PAGESIZE
    assert reserved <= 1.01 * asked
    pow2 = host_memory.caching_allocator_bytes(asked)  # what the pinned caching allocator takes
    assert pow2 & (pow2 - 1) == 0 and reserved <= pow2 < 2 * asked


def test_the_host_refuses_a_tier_it_cannot_hold_before_anything_is_mapped(monkeypatch) -> None:
    monkeypatch.setattr(host_memory, "host_bytes_available", lambda: 3 * GIB)

    def no_map(*args, **kwargs):
        raise AssertionError("the tier was mapped before the check")

    monkeypatch.setattr(host_memory.mmap, "mmap", no_map)
    with pytest.raises(CapacityError, match=r"needs 4\.00 GiB of host memory .* has 3\.00 GiB available"):
        host_memory.allocate_tier((4, 2**20, 1024), pin=False)


def test_a_tier_reads_as_zeros_and_keeps_what_is_written() -> None:
    tier = host_memory.allocate_tier((3, 1001, 7), pin=False)
    assert tier.shape == (3, 1001, 7) and tier.dtype == torch.uint8 and not tier.any()
    tier[1, 1000] = torch.arange(7, dtype=torch.uint8)
    view = tier[1]
    del tier
    assert view[1000].tolist() == list(range(7))  # a view keeps the map alive


def test_available_memory_is_read_from_the_kernel() -> None:
    """Where the kernel says (Linux's /proc/meminfo), the check has a figure to compare against."""
    available = host_memory.host_bytes_available()
    if host_memory._MEMINFO.exists():
        assert available is not None and available > 0
    else:
        assert available is None


def test_stats_report_the_tiers_host_bytes() -> None:
    pool = small_pool(gpu_slots=5, cpu_slots=11, bytes_per_layer=12, num_layers=3, layers_per_group=1)
    tier = pool.internals().runner.state.cpu_data  # 3 layers of the CPU rows (staging included) + 1, of 12 B
    assert tier.shape[0] == 3 and tier.shape[2] == 12
    asked = tier.nbytes
    stats = pool.stats()
    assert stats["host_bytes_reserved"] == host_memory.reserved_bytes(asked) >= asked
