"""What ``prepare`` accepts and returns, shape by shape (``docs/design.md``, section 5; invariant 3 of
section 4: every selected entry is on the GPU and its slot holds its bytes).

Selections come as ``[B, K]`` or speculative ``[B, Q, K]`` tensors of int32 or int64 addresses,
padded with -1 and full of duplicates (a request repeats addresses across its query positions). The
slots come back int32 in the selection's shape, -1 for padding, one slot per distinct address;
duplicates count once (so more entries than GPU slots may fit), a second identical ``prepare`` is
all hits and moves nothing, an empty or all-padding selection counts and moves nothing, and index
tensors that are strided views mean the addresses they show. The tiered pool throughout; the last
two over every kind (the tiered pool and both baselines, from ``helpers.loaded_pool``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import (
    KINDS,
    RowModel,
    addr_tensor,
    assert_reads,
    assert_selection_holds,
    fill,
    loaded_pool,
    random_rows,
    small_pool,
)

# --------------------------------------------------------------------------------------------------
# the tiered pool: the all-hit fast path, padding, duplicates


SELECTIONS: list[tuple[str, torch.dtype, Callable[[list[int], list[int]], list]]] = [
    ("bk-2x3", torch.int64, lambda a, b: [a[:3], b[:3]]),
    ("bk-1x6-int32", torch.int32, lambda a, b: [a[2:8]]),
    (
        "bqk-2x3x3-overlap",
        torch.int64,
        lambda a, b: [[a[0:3], a[1:4], a[2:5]], [b[0:3], b[0:3], [b[3], -1, b[0]]]],
    ),
    (
        "bqk-1x2x4-padded",
        torch.int32,
        lambda a, b: [[[a[7], -1, a[8], -1], [-1, a[8], a[9], a[7]]]],
    ),
]


@pytest.mark.parametrize(("dtype", "build"), [c[1:] for c in SELECTIONS], ids=[c[0] for c in SELECTIONS])
def test_second_prepare_is_all_hits_and_moves_nothing(dtype: torch.dtype, build: Callable) -> None:
    pool = small_pool(gpu_slots=13, cpu_slots=7, bytes_per_layer=12)
    model = RowModel(12)
    a = pool.admit(num_tokens=10)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    fill(pool, model, A + B, seed=7)  # 16 entries a group, 13 GPU slots: 3 on the CPU
    topk = addr_tensor(build(A, B), dtype)
    rows = topk.view(topk.shape[0], -1)
    distinct_per_request = [sorted({x for x in r.tolist() if x >= 0}) for r in rows]
    n_distinct = sum(len(d) for d in distinct_per_request)
    for group in range(pool.num_groups):
        flat = [x for d in distinct_per_request for x in d]
        resident = sum(r >= 0 for r in pool.residency(group, addr_tensor(flat)).tolist())
        s0 = pool.stats()
        first = pool.prepare(group, topk)
        assert first.group == group
        s1 = pool.stats()
        assert s1["hits"] - s0["hits"] == resident
        assert s1["misses"] - s0["misses"] == n_distinct - resident
        assert_selection_holds(pool, model, group, topk, first.slots)
        second = pool.prepare(group, topk)
        s2 = pool.stats()
        assert torch.equal(second.slots, first.slots)
        assert s2["hits"] - s1["hits"] == n_distinct
        assert s2["misses"] == s1["misses"]
        for key in ("bytes_in", "bytes_out", "victims", "distinct_entries", "physical_slots_used"):
            assert s2[key] == s1[key], key
        assert_selection_holds(pool, model, group, topk, second.slots)
    assert_reads(pool, model, A + B)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_padding_shapes_and_duplicates(dtype: torch.dtype) -> None:
    pool = small_pool(gpu_slots=7, cpu_slots=13, bytes_per_layer=5)
    model = RowModel(5)
    a = pool.admit(num_tokens=6)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    fill(pool, model, A + B, seed=11)

    # All padding: all -1, nothing counted or moved.
    s0 = pool.stats()
    pad = pool.prepare(1, torch.full((2, 3, 4), -1, dtype=dtype))
    assert pad.slots.shape == (2, 3, 4) and pad.slots.dtype == torch.int32
    assert bool((pad.slots == -1).all())
    s1 = pool.stats()
    for key in ("hits", "misses", "bytes_in", "bytes_out", "victims"):
        assert s1[key] == s0[key], key

    # [B=2, Q=3, K=4]: request 0 repeats 3 addresses across its 3 query positions, request 1 uses 4;
    # 24 entries, 7 distinct = G: fits, because duplicates count once.
    topk = addr_tensor(
        [
            [[A[0], A[1], -1, A[2]], [A[2], A[0], A[1], -1], [-1, -1, A[1], A[1]]],
            [[B[3], B[4], B[5], B[0]], [B[0], -1, B[3], B[4]], [B[5], B[5], B[5], B[5]]],
        ],
        dtype,
    )
    sel = pool.prepare(0, topk)
    s2 = pool.stats()
    assert (s2["hits"] - s1["hits"]) + (s2["misses"] - s1["misses"]) == 3 + 4
    assert_selection_holds(pool, model, 0, topk, sel.slots)

    # [B, K] with more entries than GPU slots but few distinct addresses.
    wide = addr_tensor([[B[1], B[2]] * 8 + [-1]], dtype)
    sel = pool.prepare(1, wide)
    s3 = pool.stats()
    assert (s3["hits"] - s2["hits"]) + (s3["misses"] - s2["misses"]) == 2
    assert_selection_holds(pool, model, 1, wide, sel.slots)
    assert_reads(pool, model, A + B)


# --------------------------------------------------------------------------------------------------
# every kind: empty selections, strided index tensors


@pytest.mark.parametrize("kind", KINDS)
def test_empty_and_all_padding_selections_move_nothing(kind: str) -> None:
    s = loaded_pool(kind)
    L = s.live.tolist()
    before = s.pool.stats()
    for group, topk in [
        (0, torch.empty(2, 0, dtype=torch.int64)),
        (1, torch.empty(0, 3, 2, dtype=torch.int32)),
        (0, torch.full((2, 3), -1, dtype=torch.int64)),
        (1, torch.full((1, 2, 2), -1, dtype=torch.int32)),
    ]:
        slots = s.pool.prepare(group, topk).slots
        assert slots.dtype == torch.int32 and slots.shape == topk.shape
        assert bool((slots == -1).all())
    after = s.pool.stats()
    assert {k: v for k, v in after.items() if k != "launches"} == {
        k: v for k, v in before.items() if k != "launches"
    }
    # The entries the loaded pool selected last in group 0 are still there: selecting them hits.
    s.pool.prepare(0, torch.tensor([L[:3]]))
    assert s.pool.stats()["hits"] == before["hits"] + 3


@pytest.mark.parametrize("what", ["write", "read", "prepare"])
@pytest.mark.parametrize("kind", KINDS)
def test_strided_index_tensors(kind: str, what: str) -> None:
    """Index tensors that are views with a stride (``addrs[::3]``, ``topk[:, ::3]``, whose
    ``reshape(-1)`` is itself a strided view) mean the addresses they show."""
    s = loaded_pool(kind)
    L = s.live[:9]  # every third of nine is three: the offload baseline's quota
    every_third = L[::3]  # [L0, L3, L6], stride 3
    written = s.model.expected(2, every_third.tolist())  # what the loaded pool holds in layer 2
    if what == "write":
        others = L[[1, 2, 4]].tolist()
        rows = random_rows(61, 3, 12)
        s.pool.write(2, every_third, rows)
        assert torch.equal(s.pool.read(2, every_third.contiguous()), rows)
        assert torch.equal(s.pool.read(2, addr_tensor(others)), s.model.expected(2, others)), "others changed"
    elif what == "read":
        assert torch.equal(s.pool.read(2, every_third), written)
    else:
        topk = torch.stack([L, L])[:, ::3]  # [[L0, L3, L6], [L0, L3, L6]]
        slots = s.pool.prepare(1, topk).slots
        assert torch.equal(slots, s.pool.prepare(1, topk.contiguous()).slots)
        assert torch.equal(s.pool.gpu_buffer(2)[slots[1].long()], written)
