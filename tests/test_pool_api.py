"""The tiered pool's public calls, sizes and bookkeeping (``docs/design.md``, section 5; invariants
1 and 2 of section 4).

How groups cut the layers (the last group short), what a GPU buffer is (one dummy row past the
slots), unwritten rows reading as zeros and padding rows ignored, ``extend`` returning the new
addresses, capacity exactly GPU + CPU slots (one more token refused with nothing changed, both tiers
exactly full at ratio 1.0), and a write to an entry whose home is on the CPU leaving it there.

Pools are small and oddly sized on purpose: 7 or 13 GPU slots, rows of 656, 12 or 5 bytes (5 is no
whole number of 4-byte words, so the kernels move it byte by byte), three layers in groups of two.
Payloads are random bytes and every comparison is bit-exact, never with a tolerance.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    RowModel,
    addr_tensor,
    assert_reads,
    assert_same_state,
    assert_selection_holds,
    fill,
    random_rows,
    small_pool,
)

from ulakv import CapacityError

# --------------------------------------------------------------------------------------------------
# layout, reads, addresses


def test_group_layout_last_group_short() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=5)
    assert pool.num_groups == 2
    assert list(pool.group_layers(0)) == [0, 1]
    assert list(pool.group_layers(1)) == [2]
    assert pool.capacity == 20
    assert pool.free_addresses == 20
    for layer in range(3):
        buf = pool.gpu_buffer(layer)
        assert buf.dtype == torch.uint8
        assert buf.shape == (7 + 1, 5)


def test_unwritten_rows_read_as_zeros_and_padding_rows_are_ignored() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=12)
    model = RowModel(12)
    seq = pool.admit(num_tokens=5)
    addrs = seq.addresses.tolist()
    assert_reads(pool, model, addrs)  # nothing written yet: zeros everywhere
    # A -1 row is padding: ignored, whatever its bytes.
    model.write(pool, 0, addr_tensor([addrs[1], -1, addrs[3]]), random_rows(1, 3, 12))
    # The other layer of the same group (1) and of the other group (2) still read zeros.
    assert_reads(pool, model, addrs)
    stats = pool.stats()
    assert stats["live_addresses"] == 5
    assert stats["distinct_entries"] == stats["physical_slots_used"] == 2


def test_extend_returns_the_new_addresses() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=12)
    seq = pool.admit(num_tokens=3)
    new = pool.extend(seq, 2)
    assert new.dtype == torch.int64
    assert len(seq) == 5
    assert torch.equal(seq.addresses[-2:], new)
    assert len(set(seq.addresses.tolist())) == 5
    empty = pool.extend(seq, 0)
    assert empty.numel() == 0 and len(seq) == 5
    assert pool.free_addresses == 15


# --------------------------------------------------------------------------------------------------
# capacity: exactly G + C tokens fit, one more does not


@pytest.mark.parametrize(
    ("bpl", "gpu", "cpu"),
    [(656, 7, 13), (12, 13, 7), (5, 7, 0)],
    ids=["656-byte-rows-cpu-13-over-gpu-7", "12-byte-rows-gpu-13-over-cpu-7", "5-byte-rows-gpu-only"],
)
def test_capacity_is_exactly_gpu_plus_cpu(bpl: int, gpu: int, cpu: int) -> None:
    pool = small_pool(gpu_slots=gpu, cpu_slots=cpu, bytes_per_layer=bpl)
    model = RowModel(bpl)
    cap = gpu + cpu
    assert pool.capacity == cap
    first = cap // 3
    a = pool.admit(num_tokens=first)
    b = pool.admit(num_tokens=cap - first - 3)
    pool.extend(b, 2)
    pool.extend(a, 1)
    assert pool.free_addresses == 0
    addrs = a.addresses.tolist() + b.addresses.tolist()
    assert sorted(addrs) == list(range(cap)), "exactly the capacity's addresses, each once"

    before = pool.state_dict()
    for call in (
        lambda: pool.admit(num_tokens=1),
        lambda: pool.admit(num_tokens=cap),
        lambda: pool.extend(a, 1),
        lambda: pool.extend(b, 3),
    ):
        with pytest.raises(CapacityError):
            call()
        assert pool.free_addresses == 0
        assert len(a) == first + 1 and len(b) == cap - first - 1
        assert_same_state(before, pool.state_dict())
    assert pool.admit(num_tokens=0).addresses.numel() == 0  # zero tokens always fit

    fill(pool, model, addrs, seed=bpl)
    stats = pool.stats()
    groups = pool.num_groups
    assert stats["live_addresses"] == cap
    assert stats["distinct_entries"] == cap * groups
    assert stats["physical_slots_used"] == cap * groups  # ratio 1.0: one home per entry
    assert stats["gpu_slots_used"] == gpu * groups  # both tiers exactly full
    assert stats["cpu_slots_used"] == cpu * groups
    assert_reads(pool, model, addrs)
    pool.check_invariants()

    # Swap a full GPU's worth in from the CPU (GPU-only pool: re-select): still 1.0, still exact.
    res = pool.residency(0, addr_tensor(addrs)).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    chosen = (on_cpu + [x for x in addrs if x not in on_cpu])[:gpu]
    sel = pool.prepare(0, addr_tensor(chosen).view(1, -1))
    assert_selection_holds(pool, model, 0, addr_tensor(chosen).view(1, -1), sel.slots)
    stats = pool.stats()
    assert stats["distinct_entries"] == stats["physical_slots_used"] == cap * groups
    assert_reads(pool, model, addrs)

    pool.release(a)
    pool.release(b)
    assert pool.free_addresses == cap
    stats = pool.stats()
    assert stats["live_addresses"] == 0
    assert stats["physical_slots_used"] == stats["distinct_entries"] == 0
    assert stats["gpu_slots_used"] == stats["cpu_slots_used"] == 0
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# a write lands where its entry lives


def test_write_to_cpu_home_stays_on_cpu() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=656)
    model = RowModel(656)
    seq = pool.admit(num_tokens=12)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=13)
    res = pool.residency(1, seq.addresses).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    assert len(on_cpu) == 12 - 7
    s0 = pool.stats()
    model.write(pool, 2, addr_tensor(on_cpu[:3]), random_rows(14, 3, 656))
    s1 = pool.stats()
    assert pool.residency(1, seq.addresses).tolist() == res  # written where it lives: no move
    for key in ("bytes_in", "victims"):
        assert s1[key] == s0[key], key
    # The rows themselves may count as GPU->CPU traffic (on a GPU they come from device memory);
    # nothing else may leave the GPU.
    assert s1["bytes_out"] - s0["bytes_out"] in (0, 3 * 656)
    assert_reads(pool, model, addrs)


@pytest.mark.parametrize("kind", ["tiered", "striped-local", "offload"])
def test_memory_reports_each_tensor_once_by_purpose(kind: str) -> None:
    """``memory()``: the rows where they are (every layer, the dummy row too), the CPU tier's
    staging rows apart, and the rest as metadata; what ``ulakv capacity`` sizes systems from."""
    from ulakv import CPUOffloadBaseline, EntrySpec, MemoryReport, Pool, PoolConfig, Striped, Tiered

    layers, width, gpu, cpu = 3, 7, 10, 30
    tiered = Tiered(gpu_slots=gpu, cpu_slots=cpu)
    layout = {
        "tiered": tiered,
        "striped-local": Striped(world=2, rank=1, attention="local", inner=tiered),
        "offload": CPUOffloadBaseline(cpu_slots=cpu, slots_per_request=4, max_requests=2),
    }[kind]
    pool = Pool(PoolConfig(entry=EntrySpec(bytes_per_layer=width), num_layers=layers, layout=layout))
    report = pool.memory()
    assert isinstance(report, MemoryReport) and report.gpu_meta > 0 and report.gpu_index == 0
    if kind == "offload":  # two buffers of 4 slots and a dummy each, one shared dummy; the history
        assert report.gpu_rows == 0 and report.gpu_buffers == layers * (2 * 5 + 1) * width
        assert report.cpu_rows == layers * (cpu + 1) * width and report.cpu_staging == 0  # and a dummy
    else:
        assert report.gpu_rows == layers * (gpu + 1) * width and report.gpu_buffers == 0
        staging = tiered.cpu_staging
        assert report.cpu_staging == layers * staging * width > 0
        assert report.cpu_rows == layers * (cpu + 1) * width  # the tier and its dummy row
    assert report.gpu == report.gpu_rows + report.gpu_buffers + report.gpu_index + report.gpu_meta
    assert (report + report).cpu == 2 * report.cpu


def test_help_of_pool_lists_what_a_pool_offers() -> None:
    """``Pool(config)`` builds a kind, so ``help(ulakv.Pool)`` lists the calls every pool offers,
    each with its summary, rather than only the factory; ``stats()`` says what each field counts."""
    import pydoc

    import ulakv

    text = pydoc.render_doc(ulakv.Pool, renderer=pydoc.plaintext)
    for call in ("admit(", "prepare(", "write(", "release(", "stats(", "memory(", "capacity (property)"):
        assert call in text, call
    assert "GPU-resident" in text  # prepare's summary, not only its name
    stats_doc = ulakv.Pool.__doc__
    assert "stats(self)" in stats_doc
    from ulakv.layouts.tiered import TieredPool

    for field in ("gpu_slots_used", "distinct_entries", "clean_evictions", "per layer group"):
        assert field in TieredPool.stats.__doc__, field
