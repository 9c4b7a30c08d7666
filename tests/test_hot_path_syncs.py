"""No host synchronisation on the hot path (``docs/design.md``, section 3, "Host syncs"; section 5).

With validation off (the default on CUDA), ``write`` and ``prepare`` (swap-ins, evictions, speculative
``[B, Q, K]`` selections with padding and duplicates) and the per-step bookkeeping (``admit``,
``extend``, ``release``) make no device read-back: every one would be an error inside
``tests/nosync.py``'s ``no_host_sync()``. The slots and bytes each ``prepare`` produced inside the
block are checked afterwards against a model replayed outside it. First, a check that the detector
these tests rely on is live: the read-backs it names raise inside the block and not after it. The
pool tests are skipped under ``ULAKV_DEBUG=1``, which validates and checks the pool after every call.
"""

from __future__ import annotations

import pytest
import torch
from helpers import RowModel, addr_tensor, assert_reads, random_rows, small_pool
from nosync import HostSyncError, no_host_sync, skip_under_debug


def test_no_host_sync_patch_is_effective() -> None:
    t = torch.tensor([3, 1, 3])
    with no_host_sync():
        for call in (
            t[0].item,  # a one-element tensor: item on three elements fails before reading anything
            t.tolist,
            lambda: bool(t[0]),
            lambda: int(t[0]),
            lambda: torch.unique(t),
        ):
            with pytest.raises(HostSyncError):
                call()
        with pytest.raises(HostSyncError):
            t.nonzero()
    assert torch.unique(t).tolist() == [1, 3]  # undone


@skip_under_debug
def test_hot_path_never_syncs() -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=5, validate=False)
    model = RowModel(5)
    a = pool.admit(num_tokens=9)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    # Inputs prepared before the patch (building them is the test's business, not the pool's).
    writes = []
    for layer in range(3):
        writes.append((layer, addr_tensor(A[:5]), random_rows(10 + layer, 5, 5)))
    for layer in range(3):
        writes.append((layer, addr_tensor(A[5:] + B), random_rows(20 + layer, 10, 5)))
    steps: list[tuple[str, int, torch.Tensor, torch.Tensor | None]] = [("w", *w) for w in writes]
    steps += [
        ("p", 0, addr_tensor([B[:4], [*A[:3], -1]]), None),  # B is on the CPU: swaps in, evicts A
        (
            "p",
            1,
            addr_tensor([[[B[0], B[1], -1], [B[1], B[2], B[5]]], [[A[8], -1, A[7]], [A[7], A[6], A[8]]]]),
            None,
        ),
        ("p", 0, addr_tensor([[A[5], A[6], A[7], -1], [B[4], B[5], B[4], -1]], torch.int32), None),
        ("w", 1, addr_tensor([A[0], -1, B[5]]), random_rows(30, 3, 5)),
        ("w", 0, addr_tensor([B[0], A[1]], torch.int32), random_rows(31, 2, 5)),
        ("p", 0, addr_tensor([[*A[:3], -1], B[:4]]), None),
        ("p", 1, addr_tensor([A[:6]]), None),
        ("w", 2, addr_tensor([A[2], B[3]]), random_rows(32, 2, 5)),
        ("p", 1, addr_tensor([[A[2], B[3], -1]]), None),
    ]
    captured = []
    with no_host_sync():
        for kind, idx, addrs, rows in steps:
            if kind == "w":
                pool.write(idx, addrs, rows)
            else:
                sel = pool.prepare(idx, addrs)
                bufs = [pool.gpu_buffer(layer).clone() for layer in pool.group_layers(idx)]
                captured.append((sel.slots.clone(), bufs))
    pool.check()
    # Replay on the model and check every prepare's slots held the right bytes at that time.
    k = 0
    for kind, idx, addrs, rows in steps:
        if kind == "w":
            for x, row in zip(addrs.tolist(), rows, strict=True):
                if x >= 0:
                    model.rows[(idx, x)] = row.clone()
            continue
        slots, bufs = captured[k]
        k += 1
        assert slots.shape == addrs.shape and slots.dtype == torch.int32
        assert torch.equal(slots == -1, addrs == -1)
        mask = addrs >= 0
        for layer, buf in zip(pool.group_layers(idx), bufs, strict=True):
            got = buf[slots[mask].long()]
            assert torch.equal(got, model.expected(layer, addrs[mask].tolist())), (k, layer)
    stats = pool.stats()
    assert stats["victims"] > 0 and stats["bytes_in"] > 0 and stats["bytes_out"] > 0
    assert stats["distinct_entries"] == stats["physical_slots_used"]
    assert_reads(pool, model, A + B)
    pool.check_invariants()


@skip_under_debug
def test_admission_extend_and_release_never_sync() -> None:
    """Per-step bookkeeping stays off the device's critical path too: host lists in, async copies."""
    pool = small_pool(
        gpu_slots=5, cpu_slots=9, bytes_per_layer=4, num_layers=2, layers_per_group=1, validate=False
    )
    with no_host_sync():
        seq = pool.admit(num_tokens=3)
        new = pool.extend(seq, 2)
        pool.write(0, new, torch.zeros((2, 4), dtype=torch.uint8))
        other = pool.admit(num_tokens=4)
        pool.release(seq)
        pool.release(other)
    assert new.tolist() == [3, 4]
    assert pool.free_addresses == pool.capacity
    pool.check_invariants()
