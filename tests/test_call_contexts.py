"""Consecutive groups' calls share no control word or scratch (``TieredRunner`` call contexts), so
group ``g + 1``'s plan may run while group ``g``'s rows move.

Shown by construction, from the launches themselves: every tensor argument of every kernel a
group's write and prepare launch, as a memory range, against those of the next group's. The only
overlaps allowed are what neither call writes where the other looks: the callers' own inputs
(one selection may serve both), PB-LRU's level offsets (read-only), and the whole-tier row tensors,
of which a call touches only its own group's layers. Groups two apart share a context, and the
same check finds their shared words: it can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_rows

from ulakv import PBLRU, EntrySpec, ExactLRU, InvalidAddressError, Pool, PoolConfig, Tiered
from ulakv.kernels._triton import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="records the interpreter's launches")

WIDTH = 8
# The callers' inputs (a selection, a prepare's new tokens, rows), read-only level offsets, the
# whole-tier rows, and apply's home claims: a one-word stand-in never written unless ULAKV_DEBUG
# (then a row a group).
SHARED_BY_DESIGN = {"sel_ptr", "new_ptr", "rows_ptr", "lvl_ptr", "gpu_ptr", "cpu_ptr", "claims_ptr"}


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + t.element_size() * (last + 1)


def launched(fn) -> list[tuple[str, str, int, int]]:
    """(kernel, argument, start, end) of every non-empty tensor argument launched by ``fn()``."""
    from triton.runtime.interpreter import InterpretedFunction as launcher

    original, seen = launcher.run, []

    def run(self, *args, **kwargs):
        for name, t in [*enumerate(args), *kwargs.items()]:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                seen.append((self.fn.__name__, str(name), *_span(t)))
        return original(self, *args, **kwargs)

    launcher.run = run
    try:
        fn()
    finally:
        launcher.run = original
    return seen


def shared(a, b) -> set[tuple[str, str]]:
    """Arguments of ``a``'s launches whose memory overlaps an argument of ``b``'s."""
    return {
        (ka, na)
        for ka, na, sa, ea in a
        for kb, nb, sb, eb in b
        if sa < eb and sb < ea and not (na in SHARED_BY_DESIGN and nb in SHARED_BY_DESIGN)
    }


def _pool(policy) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=5,
            layers_per_group=1,
            layout=Tiered(gpu_slots=8, cpu_slots=30, policy=policy),
            validate=False,
        )
    )


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru"])
def test_consecutive_groups_share_no_call_word_or_scratch(policy) -> None:
    pool = _pool(policy)
    gen = torch.Generator().manual_seed(3)
    seq = pool.admit(20)
    for layer in range(5):
        pool.write(layer, seq.addresses, random_rows(gen, 20, WIDTH))
    selection = seq.addresses[4:10].view(1, 6)  # one selection for every group: read by all
    new, rows = seq.addresses[:3], random_rows(gen, 3, WIDTH)
    kept = []  # each group's slots, alive as an engine keeps them: no memory handed on

    def step(group: int):
        return launched(lambda: (pool.write(group, new, rows), kept.append(pool.prepare(group, selection))))

    calls = [step(g) for g in range(5)]
    for g in range(4):
        assert shared(calls[g], calls[g + 1]) == set(), f"groups {g} and {g + 1} share memory"
    # Two apart: the same context, and the check sees its words (control words, scratch, claims).
    two_apart = {name for _, name in shared(calls[1], calls[3])}
    # (Each group reports a refusal to a word of its own, so that the error can name the group.)
    assert {"ctl_ptr", "claim_ptr", "counts_ptr", "stats_ptr"} <= two_apart
    assert "report_ptr" not in two_apart
    pool.check()


def test_counters_and_refusals_span_the_contexts() -> None:
    pool = _pool(ExactLRU())
    gen = torch.Generator().manual_seed(4)
    seq = pool.admit(12)
    for layer in range(5):
        pool.write(layer, seq.addresses, random_rows(gen, 12, WIDTH))
    for group in range(5):
        pool.prepare(group, seq.addresses[6:].view(2, 3))  # 4 of them on the CPU: evictions
    stats = pool.stats()
    assert stats["hits"] + stats["misses"] == 5 * 6  # each group's six, whichever context counted
    assert stats["misses"] == stats["victims"] == 5 * 4 and stats["bytes_in"] == 5 * 4 * WIDTH
    pool.prepare(1, torch.tensor([[int(seq.addresses[0]), 40]]))  # context 1: not live
    with pytest.raises(InvalidAddressError, match=r"an earlier prepare of layer group 1 \(refused"):
        pool.prepare(2, seq.addresses[:2].view(1, 2))  # context 0 raises it
    pool.write(3, torch.tensor([40]), random_rows(gen, 1, WIDTH))  # context 1 again
    with pytest.raises(InvalidAddressError, match=r"an earlier write to layer group 3 \(refused"):
        pool.check()
    pool.check()


ENGINE_SHARED_BY_DESIGN = {"map_ptr", "claim_ptr"}  # the mapping; stamps, after a join (below)


def _engine_pool(layers: int) -> Pool:
    """A pool whose addresses the engine owns, one-layer groups."""
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=layers,
            layout=Tiered(gpu_slots=8, cpu_slots=30),
            engine_addresses=64,
            validate=False,
        )
    )


def test_engine_calls_share_no_word_with_a_call_context() -> None:
    """An engine's admit and release check on words of their own: status, refusal count and report
    are never a call context's (a prepare planning on a side stream read-modify-writes those). What
    they share is the mapping they change and context 0's claim words, for the check's stamps;
    both are safe because the pool joins the adapter's streams first (the next test)."""
    pool = _engine_pool(3)
    gen = torch.Generator().manual_seed(5)
    locs = torch.tensor([9, 3, 17, 40])
    engine = launched(lambda: pool.admit_addresses(locs))
    for layer in range(3):
        pool.write(layer, locs.clone(), random_rows(gen, 4, WIDTH))
    calls = [launched(lambda g=g: pool.prepare(g, locs.clone().view(1, 4))) for g in range(3)]
    engine += launched(lambda: pool.release_addresses(locs[:2]))
    # The check and its marking, and what the release kernel reads of it (its other arguments are
    # the groups' state it frees homes in, as a pool-owned release does).
    engine = [a for a in engine if a[0] != "release_kernel" or a[1] == "ctl_ptr"]
    for g, call in enumerate(calls):
        words = {name for _, name in shared(engine, call)} - ENGINE_SHARED_BY_DESIGN
        assert words == set(), f"the engine's check shares {words} with group {g}'s calls"
    pool.admit_addresses(torch.tensor([3, 3]))  # refused on its own words: raised at the next call
    with pytest.raises(InvalidAddressError, match="an earlier admit_addresses"):
        pool.prepare(1, locs[2:].view(1, 2))


def test_a_raised_refusal_writes_no_device_word() -> None:
    """The host learns a refusal from the counts in the report words and writes nothing back: a
    clear of a context's pending word from another stream could land between that context's
    planner reading and writing it, and bring the refusal back."""
    pool = _pool(ExactLRU())
    seq = pool.admit(4)
    pool.write(0, seq.addresses, random_rows(torch.Generator().manual_seed(6), 4, WIDTH))
    pool.prepare(1, torch.tensor([[int(seq.addresses[0]), 40]]))  # context 1: refused
    contexts = pool.internals().runner.contexts
    before = [st.ctl.clone() for st in contexts]
    with pytest.raises(InvalidAddressError, match=r"an earlier prepare of layer group 1"):
        pool.prepare(0, seq.addresses[:2].view(1, 2))  # context 0's call raises it, launching nothing
    for at, (st, words) in enumerate(zip(contexts, before, strict=True)):
        assert torch.equal(st.ctl, words), f"context {at}'s control words were written"
    pool.check()  # raised once: not again at a synchronising call
    pool.prepare(1, seq.addresses[:2].view(1, 2))
    pool.check()


def test_pool_wide_calls_join_the_adapters_streams_first() -> None:
    """``SparseKV`` registers its streams' join with the pool (``order_after``); every call that acts
    on the whole pool or reads it back runs it first, and a group's own calls do not (they run on
    the group's stream, beside the other context's)."""
    from ulakv.engine import SparseKV

    pool = _engine_pool(2)
    kv = SparseKV(pool, max_batch=2, top_k=4)
    assert [held() for held in pool.internals().joins] == [kv.internals().after_streams]
    del kv  # a dropped adapter's join goes with it (held weakly)
    assert [held() for held in pool.internals().joins] == [None]
    kv = SparseKV(pool, max_batch=2, top_k=4)
    joins = []
    pool.order_after(lambda: joins.append(1))
    locs = torch.tensor([9, 3, 17, 40])
    gen = torch.Generator().manual_seed(7)
    calls = {
        "admit_addresses": lambda: pool.admit_addresses(locs),
        "write": lambda: kv.write(0, locs, random_rows(gen, 4, WIDTH)),
        "prepare": lambda: kv.prepare(1, locs.view(1, 4)),
        "read": lambda: pool.read(0, locs[:1]),
        "residency": lambda: pool.residency(0, locs),
        "stats": pool.stats,
        "check_invariants": pool.check_invariants,
        "live_addresses": pool.live_addresses,
        "release_addresses": lambda: pool.release_addresses(locs),
    }
    for name, call in calls.items():
        joins.clear()
        call()
        assert bool(joins) == (name not in ("write", "prepare")), name
