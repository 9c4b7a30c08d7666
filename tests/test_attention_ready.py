"""Attention-ready memory: ``paged_buffer`` views the GPU rows as a paged KV cache (FlashMLA's page
size 64, and odd ones), the same memory ``gpu_buffer`` and the slots index; the rows past the dummy
are never written, through eviction and release."""

from __future__ import annotations

import pytest
import torch

from ulakv import ConfigError, Pool
from ulakv.config import EntrySpec, PoolConfig, Replicated, Striped, Tiered


@pytest.mark.parametrize(
    ("layout", "page"),
    [
        (Tiered(gpu_slots=5, cpu_slots=9), 64),
        (Tiered(gpu_slots=63, cpu_slots=4), 64),  # G + 1 = 64: exactly one page
        (Tiered(gpu_slots=6, cpu_slots=7), 7),
        (Tiered(gpu_slots=4), 1),
        (Replicated(world=2, gpu_slots=9), 4),
    ],
    ids=["G5-p64", "G63-p64", "G6-p7", "G4-p1", "replicated-p4"],
)
def test_paged_view_reads_what_prepare_returns(layout, page: int) -> None:
    pool = Pool(PoolConfig(EntrySpec(12), num_layers=3, layers_per_group=3, layout=layout, page_size=page))
    G = layout.gpu_slots
    rows_per_layer = -(-(G + 1) // page) * page
    for layer in range(3):
        paged = pool.paged_buffer(layer)
        assert paged.shape == (rows_per_layer // page, page, 1, 12)
        assert paged.data_ptr() == pool.gpu_buffer(layer).data_ptr()
    paged_flat = [pool.paged_buffer(layer).view(-1, 12) for layer in range(3)]
    paged_flat[0][G + 1 :] = 0xAB  # poison the rows past the dummy: nothing may write them
    n = min(pool.capacity, 2 * G)
    seq = pool.admit(n)
    data = torch.randint(0, 256, (3, n, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for layer in range(3):
        pool.write(layer, seq.addresses, data[layer])
    limit = pool.config.layout.max_selection
    for start in range(0, n, limit):  # every entry through the view, evicting on the way
        addrs = seq.addresses[start : start + limit]
        slots = pool.prepare(0, addrs.view(1, -1)).slots.flatten().long()
        for layer in range(3):
            assert torch.equal(paged_flat[layer][slots], data[layer, start : start + limit])
    pool.release(seq)
    assert bool((paged_flat[0][G + 1 :] == 0xAB).all())


def test_page_size_needs_a_tiered_or_replicated_layout() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        PoolConfig(EntrySpec(8), num_layers=1, layout=Striped(world=2, rank=0, buffer_slots=4), page_size=64)
    with pytest.raises(ConfigError, match="page_size"):
        PoolConfig(EntrySpec(8), num_layers=1, layout=Tiered(gpu_slots=4), page_size=0)
