"""Chunked prefill: a selection with more distinct addresses than one prepare may select, prepared a
chunk of query rows at a time; the chunk boundaries against a brute-force greedy; refusals that
change nothing; padding-only rows, a single row, a selection that fits at once."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_state, random_rows
from hypothesis import given
from hypothesis import strategies as st

from ulakv import (
    PBLRU,
    CapacityError,
    EntrySpec,
    ExactLRU,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    PoolConfig,
    Tiered,
)
from ulakv.engine import SparseKV, chunked_prepare
from ulakv.engine.prefill import PrefillChunk, plan_chunks

WIDTH, LAYERS, PER_GROUP = 8, 3, 2  # groups of 2 and 1 layers
GPU, CPU = 16, 64  # max_selection 16


def engine(policy=None, validate=None):
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=LAYERS,
            layers_per_group=PER_GROUP,
            layout=Tiered(gpu_slots=GPU, cpu_slots=CPU, policy=policy or ExactLRU()),
            validate=validate,
        )
    )
    return pool, SparseKV(pool, max_batch=2, top_k=8)


def prompt(pool, kv, tokens: int, seed: int = 0):
    """Admit a prompt of ``tokens`` tokens and write every layer; returns its addresses and the rows
    written ``[layer][position]``."""
    seq = pool.admit(tokens)
    gen = torch.Generator().manual_seed(seed)
    rows = [random_rows(gen, tokens, WIDTH) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        kv.write(layer, seq.addresses, rows[layer])
    return seq.addresses, rows


def causal_topk(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Query row ``t`` selects ``min(k, t + 1)`` positions among ``[0, t]`` (-1 padding after them),
    now and then one of them twice (a prepare allows duplicates)."""
    gen = torch.Generator().manual_seed(seed)
    sel = torch.full((tokens, k), -1, dtype=torch.int64)
    for t in range(tokens):
        n = min(k, t + 1)
        sel[t, :n] = torch.randperm(t + 1, generator=gen)[:n]
        if n > 2 and t % 5 == 0:
            sel[t, n - 1] = sel[t, 0]
    return sel


def to_addresses(positions: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    return torch.where(positions >= 0, addresses[positions.clamp(min=0)], -1)


def distinct(rows) -> set[int]:
    return {a for row in rows for a in row if a != -1}


def greedy_reference(rows: list[list[int]], bound: int, max_rows: int | None = None) -> list[range]:
    """Brute force: each chunk takes the next row while the union of its rows stays within
    ``bound`` (and its rows within ``max_rows``)."""
    for r, row in enumerate(rows):
        if len(distinct([row])) > bound:
            raise CapacityError(f"row {r}")
    chunks, start = [], 0
    while start < len(rows):
        end = start + 1
        while (
            end < len(rows)
            and (max_rows is None or end - start < max_rows)
            and len(distinct(rows[start : end + 1])) <= bound
        ):
            end += 1
        chunks.append(range(start, end))
        start = end
    return chunks


def check_chunk(pool, chunk: PrefillChunk, positions: torch.Tensor, rows, group: int) -> None:
    """The chunk's slots index, in every layer of the group, exactly the rows written for the
    positions its query rows select; -1 exactly where they select nothing."""
    pos = positions[chunk.rows.start : chunk.rows.stop]
    assert chunk.slots.shape == pos.shape and chunk.slots.dtype == torch.int32
    valid = pos >= 0
    assert torch.equal(chunk.slots == -1, ~valid)
    assert chunk.step.layers == pool.group_layers(group)
    for layer in pool.group_layers(group):
        assert torch.equal(chunk.step.wait(layer), chunk.slots)  # every layer ready (no split)
        got = pool.gpu_buffer(layer)[chunk.slots.clamp(min=0).long()]
        assert torch.equal(got[valid], rows[layer][pos[valid]]), f"layer {layer}, rows {chunk.rows}"


@pytest.mark.parametrize(
    ("policy", "validate"), [(ExactLRU(), None), (PBLRU(4), False)], ids=["lru", "pblru4"]
)
def test_a_prefill_larger_than_one_prepare_runs_in_chunks(policy, validate) -> None:
    """48 causal query rows of up to 6 picks: together 48 distinct addresses, three times what a
    prepare may select. Every chunk fits, the chunks are the greedy ones, and each one's slots read
    back the bytes written, in every layer of its group, while the pool evicts between chunks."""
    pool, kv = engine(policy, validate)
    T, K = 48, 6
    addresses, rows = prompt(pool, kv, T)
    positions = causal_topk(T, K)
    topk = to_addresses(positions, addresses)
    bound = pool.config.layout.max_selection
    assert len(distinct(topk.tolist())) > 2 * bound
    for group in range(pool.num_groups):
        before = pool.stats()
        chunks = []
        for chunk in chunked_prepare(kv, group, topk):
            check_chunk(pool, chunk, positions, rows, group)  # before the next chunk is prepared
            chunks.append(chunk.rows)
        assert [r for c in chunks for r in c] == list(range(T))  # every row once, in order
        assert all(len(distinct(topk[c.start : c.stop].tolist())) <= bound for c in chunks)
        assert chunks == greedy_reference(topk.tolist(), bound)
        assert len(chunks) > 2
        after = pool.stats()
        assert after["misses"] > before["misses"] and after["victims"] > before["victims"]
    pool.check()
    pool.check_invariants()


@given(
    data=st.data(),
    T=st.integers(0, 24),
    K=st.integers(0, 6),
    space=st.integers(1, 20),
    bound=st.integers(1, 10),
    max_rows=st.none() | st.integers(1, 5),
    spread=st.sampled_from([1, 1_000_003]),  # sparse large addresses: planned renumbered densely
)
def test_boundaries_are_the_brute_force_greedy(data, T, K, space, bound, max_rows, spread) -> None:
    rows = data.draw(
        st.lists(st.lists(st.integers(-1, space - 1), min_size=K, max_size=K), min_size=T, max_size=T)
    )
    rows = [[a * spread if a != -1 else -1 for a in row] for row in rows]
    topk = torch.tensor(rows, dtype=torch.int64).view(T, K)
    over = [r for r, row in enumerate(rows) if len(distinct([row])) > bound]
    if over:
        n = len(distinct([rows[over[0]]]))
        with pytest.raises(
            CapacityError, match=rf"row {over[0]} selects {n} distinct addresses, more than the {bound}"
        ):
            plan_chunks(topk, bound, max_rows=max_rows)
        return
    chunks = plan_chunks(topk, bound, max_rows=max_rows)
    assert chunks == greedy_reference(rows, bound, max_rows)
    assert [r for c in chunks for r in c] == list(range(T))


def test_a_row_over_the_bound_is_refused_and_changes_nothing() -> None:
    """Refusals are decided at the call, before anything moves: a row that alone selects more than
    a prepare may, addresses out of range or not live, bad arguments."""
    pool, kv = engine()
    addresses, _ = prompt(pool, kv, 40)
    gone = pool.admit(2)
    dead = gone.addresses.clone()
    kv.release(gone)
    topk = to_addresses(causal_topk(24, 4, seed=1), addresses)
    wide = torch.full((24, 17), -1, dtype=torch.int64)
    wide[:, :4] = topk
    wide[9] = addresses[:17]  # row 9: 17 distinct, one more than the 16 a prepare may select
    before = pool.stats()
    state = pool.state_dict()
    refusals = [
        (wide, {}, CapacityError, r"row 9 selects 17 distinct addresses, more than the 16"),
        (topk, {"max_distinct": 3}, CapacityError, r"row 3 selects 4 distinct addresses, more than the 3"),
        (torch.cat([topk, dead.view(2, 1).expand(2, 4)]), {}, InvalidAddressError, "not live"),
        (torch.cat([topk, torch.full((1, 4), 10**6)]), {}, InvalidAddressError, r"out of range.*1000000"),
        (torch.cat([topk, torch.full((1, 4), -2)]), {}, InvalidAddressError, r"out of range.*-2"),
        (topk, {"max_distinct": 17}, InvalidInputError, "exceeds the 16"),
        (topk, {"max_rows": 0}, InvalidInputError, "max_rows must be a positive int"),
        (topk.view(2, 12, 4), {}, InvalidInputError, r"\[T, K\]"),
        (topk.float(), {}, InvalidInputError, r"\[T, K\]"),
    ]
    for sel, kwargs, error, message in refusals:
        with pytest.raises(error, match=message):
            chunked_prepare(kv, 0, sel, **kwargs)  # raised at the call, not at the first chunk
    with pytest.raises((InvalidInputError, InvalidAddressError)):
        chunked_prepare(kv, 2, topk)  # no group 2
    assert_same_state(state, pool.state_dict())
    after = pool.stats()
    assert {k: v for k, v in after.items() if k != "launches"} == {
        k: v for k, v in before.items() if k != "launches"
    }
    pool.check_invariants()


def test_padding_rows_a_single_row_and_a_selection_that_fits() -> None:
    pool, kv = engine()
    addresses, rows = prompt(pool, kv, 30, seed=2)
    # Padding-only rows (at the start, in the middle, at the end) never end a chunk.
    positions = causal_topk(12, 4, seed=3)
    positions[[0, 1, 6, 7, 11]] = -1
    topk = to_addresses(positions, addresses).to(torch.int32)
    assert len(distinct(topk.tolist())) <= GPU
    chunks = list(chunked_prepare(kv, 0, topk))
    assert [c.rows for c in chunks] == [range(12)]  # fits: exactly one chunk
    check_chunk(pool, chunks[0], positions, rows, 0)
    # Only padding: one chunk of -1 slots, nothing moved.
    before = pool.stats()
    (chunk,) = chunked_prepare(kv, 1, torch.full((5, 3), -1, dtype=torch.int64))
    assert chunk.rows == range(5) and bool((chunk.slots == -1).all())
    assert pool.stats()["bytes_in"] == before["bytes_in"]
    # T = 1: one row of the whole bound.
    positions = torch.randperm(30, generator=torch.Generator().manual_seed(4))[:GPU].view(1, GPU)
    (chunk,) = chunked_prepare(kv, 1, to_addresses(positions, addresses))
    assert chunk.rows == range(1)
    check_chunk(pool, chunk, positions, rows, 1)
    # T = 0: no chunk; max_rows caps a chunk's rows.
    assert list(chunked_prepare(kv, 0, torch.empty((0, 4), dtype=torch.int64))) == []
    positions = causal_topk(7, 2, seed=5)
    got = []
    for chunk in chunked_prepare(pool, 0, to_addresses(positions, addresses), max_rows=3):  # the pool itself
        check_chunk(pool, chunk, positions, rows, 0)
        got.append(chunk.rows)
    assert got == [range(0, 3), range(3, 6), range(6, 7)]
    pool.check_invariants()
