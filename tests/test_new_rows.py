"""One plan for a layer's write and read: ``prepare(group, topk, new=NewRows(layer, addresses, rows))``.

A decode step writes its new tokens' rows and then prepares the group's selection; with ``new`` one
plan decides both: the new tokens lead the call's elements, get GPU slots (free ones first) and,
like a write's new entries, copies in plain free CPU rows (or in the row a clean victim popped).
Checked here: the kernels against their references word for word under random traffic (odd sizes,
padding, the selection naming new tokens, both tilings); what the pool holds against a row model;
the plan's decisions against the policies' rules (``ULAKV_DEBUG=1`` audits every plan); refusals
that change nothing (a new token with a home, twice among the new ones, out of range, a layer of
another group); a plan stopped after each phase; the counters (new tokens are written, not missed;
their copies are bytes out); and that later evictions of new tokens are clean.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import RowModel, addr_tensor, assert_reads, assert_same_state, expect_rejected, fill, random_rows
from tier_helpers import POLICIES, copies, deltas, row_bytes
from tier_helpers import tiered as tiered_pool

from ulakv import PBLRU, ExactLRU, NewRows
from ulakv.engine import SparseKV
from ulakv.errors import CapacityError, InvalidAddressError, InvalidInputError
from ulakv.kernels import apply as apply_mod
from ulakv.kernels import common as K
from ulakv.layouts.tiered_state import REFERENCE
from ulakv.transfer import PlanInterrupted, interrupt_after

WIDTH = 12


def tiered(policy, gpu: int, cpu: int, per_group: int = 1, layers: int = 2, write_copies: bool = True):
    """12-byte rows, ``layers`` layers in groups of ``per_group``, write copies on."""
    return tiered_pool(
        policy, gpu=gpu, cpu=cpu, layers=layers, per_group=per_group, write_copies=write_copies
    )


def with_references(pool):
    """A deep copy of ``pool`` whose calls run the kernels' plain references."""
    twin = copy.deepcopy(pool)
    twin.internals().runner.kernels = REFERENCE
    return twin


def step_traffic(pool, model, seq, addrs, rng, gen, *, group: int = 0, new_count: int = 2, pad: bool = True):
    """One decode step's call: ``new_count`` new tokens of ``seq`` (one of them padding when
    ``pad``) with a selection of live addresses that may name a new token and padding."""
    new = pool.extend(seq, new_count)
    new_sel = new.clone()
    if pad and new_count > 1 and rng.random() < 0.3:
        new_sel[rng.randrange(new_count)] = -1
    room = pool.config.layout.gpu_slots - new_count  # a prepare selects at most the GPU's slots
    k = min(len(addrs), rng.randint(1, max(1, room)))
    sel = torch.tensor(rng.sample(addrs, k), dtype=torch.int64)
    if rng.random() < 0.4:  # the selection names a new token (attention over the current token)
        sel[rng.randrange(k)] = new_sel[0]
    if rng.random() < 0.3:
        sel[rng.randrange(k)] = -1
    rows = random_rows(gen, new_count, WIDTH)
    layer = pool.config.group_layers(group).start
    return sel.view(1, k), NewRows(layer, new_sel, rows), new_sel


# --------------------------------------------------------------------------------------------------
# 1. the kernels against their references, and the pool against a row model


CASES = [
    # id, gpu, cpu, layers, per group, policy
    ("lru-1-layer-groups", 5, 40, 2, 1, ExactLRU()),
    ("lru-2-layer-group-tiny-gpu", 3, 40, 3, 2, ExactLRU()),
    ("pblru3-1-layer-groups", 5, 40, 2, 1, PBLRU(3)),
    ("pblru3-2-layer-group", 4, 40, 3, 2, PBLRU(3)),
]


@pytest.mark.parametrize(
    ("gpu", "cpu", "layers", "per_group", "policy"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("tiling", ["interp-tile", "gpu-tile"])
def test_one_plan_matches_its_references_and_holds_every_row(
    gpu, cpu, layers, per_group, policy, tiling, monkeypatch
) -> None:
    """Decode steps of one plan each (new tokens with the selection), some with a write of the
    group's other layers: the kernels and their references end in the same state word for word and
    return the same slots; the selected slots hold their rows; everything reads back as written."""
    if tiling == "gpu-tile":
        monkeypatch.setattr(apply_mod, "TILING", apply_mod.GPU_TILING)
    pool = tiered(policy, gpu=gpu, cpu=cpu, per_group=per_group, layers=layers)
    model = RowModel(WIDTH)
    seq = pool.admit(7)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=5)
    rng, gen = random.Random(gpu * 31 + layers), torch.Generator().manual_seed(per_group)
    for _ in range(8):
        group = rng.randrange(pool.num_groups)
        sel, new, new_sel = step_traffic(
            pool, model, seq, addrs, rng, gen, group=group, new_count=rng.randint(1, min(3, gpu - 1))
        )
        twin = with_references(pool)
        got = pool.prepare(group, sel, new=new)
        want = twin.prepare(group, sel, new=new)
        assert torch.equal(got.slots, want.slots)
        assert_same_state(pool.state_dict(), twin.state_dict())
        model.record(new.layer, new_sel, new.rows)
        live_new = [a for a in new_sel.tolist() if a >= 0]
        # the selection's slots hold its rows (new tokens included), every layer of the group
        pad = sel.view(-1) == -1
        for layer in pool.group_layers(group):
            held = pool.gpu_buffer(layer)[got.slots.view(-1)[~pad].long()]
            assert torch.equal(held, model.expected(layer, sel.view(-1)[~pad].tolist()))
        # new tokens are on the GPU (a free slot or a victim's), never in a CPU home
        assert (pool.residency(group, addr_tensor(live_new)) >= 0).all() if live_new else True
        for layer in range(layers):  # the other layers of the new tokens, written apart
            if layer != new.layer and live_new:
                model.write(pool, layer, addr_tensor(live_new), random_rows(gen, len(live_new), WIDTH))
        addrs += live_new
        pool.check_invariants()
    assert_reads(pool, model, addrs)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_plan_passes_the_plan_audit(policy, monkeypatch) -> None:
    """Under ``ULAKV_DEBUG=1`` every finished plan is checked against the policy's rules from a
    snapshot taken before it (free slots first, the oldest unprotected victims, nothing selected
    evicted, every element's home, the recency after): one plan's new tokens are misses like any."""
    monkeypatch.setenv("ULAKV_DEBUG", "1")
    pool = tiered(policy, gpu=4, cpu=40)
    assert pool.internals().debug
    model = RowModel(WIDTH)
    seq = pool.admit(6)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=2)
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    for _ in range(6):
        sel, new, new_sel = step_traffic(pool, model, seq, addrs, rng, gen)
        pool.prepare(0, sel, new=new)
        model.record(new.layer, new_sel, new.rows)
        model.write(pool, 1, new_sel, random_rows(gen, new_sel.numel(), WIDTH))
        addrs += [a for a in new_sel.tolist() if a >= 0]
    assert_reads(pool, model, addrs)


# --------------------------------------------------------------------------------------------------
# 2. what it costs: counters, copies, clean evictions


@pytest.mark.parametrize("policy", POLICIES)
def test_new_tokens_are_written_not_missed_and_their_copies_make_evictions_clean(policy) -> None:
    """A one-layer group of 4 GPU slots, 4 entries on the GPU: one plan of 2 new tokens and a
    selection of 2 CPU-homed entries. The misses count the selection's 2 alone; the new tokens take
    victims' slots and a copy each (2 rows out: the baseline backs a written row up too). Then a
    prepare that evicts them is clean: no byte out."""
    pool = tiered(policy, gpu=4, cpu=40)
    model = RowModel(WIDTH)
    seq = pool.admit(8)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=1)
    on_cpu = [a for a in addrs if int(pool.residency(0, addr_tensor([a]))[0]) < 0]
    rb = row_bytes(pool, 0)
    new = pool.extend(seq, 2)
    rows = random_rows(9, 2, WIDTH)
    s0 = pool.stats()
    pool.prepare(0, addr_tensor(on_cpu[:2]).view(1, 2), new=NewRows(0, new, rows))
    model.record(0, new, rows)
    d = deltas(s0, pool.stats())
    assert d["misses"] == 2 and d["hits"] == 0
    assert d["bytes_in"] == 2 * rb
    assert d["victims"] == 4
    # the victims were written entries with copies: clean; the new tokens' copies: 2 rows out
    assert d["clean_evictions"] == 4
    assert d["bytes_out"] == 2 * rb
    assert set(new.tolist()) <= set(copies(pool, 0))
    s1 = pool.stats()
    elsewhere = [a for a in addrs if int(pool.residency(0, addr_tensor([a]))[0]) < 0][:4]
    pool.prepare(0, addr_tensor(elsewhere).view(2, 2))  # evicts the new tokens among others
    d = deltas(s1, pool.stats())
    assert d["bytes_out"] == 0 and d["clean_evictions"] == d["victims"] == 4
    assert_reads(pool, model, addrs + new.tolist())
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_one_plan_equals_a_write_then_a_prepare_in_what_the_pool_holds(policy) -> None:
    """The same steps through one plan and through write-then-prepare: every row reads the same and
    the selections' slots hold the same rows. One plan moves no more bytes in: its selection is
    protected while the new tokens find slots, where a write alone may evict an entry the prepare
    then brings back."""
    fused, apart = tiered(policy, gpu=4, cpu=40), tiered(policy, gpu=4, cpu=40)
    models = RowModel(WIDTH), RowModel(WIDTH)
    seqs = [p.admit(6) for p in (fused, apart)]
    addrs = seqs[0].addresses.tolist()
    for p, m in zip((fused, apart), models, strict=True):
        fill(p, m, addrs, seed=4)
    rng = random.Random(3)
    for step in range(6):
        sel = addr_tensor(rng.sample(addrs, 3)).view(1, 3)
        rows = random_rows(50 + step, 1, WIDTH)
        new_f = fused.extend(seqs[0], 1)
        new_a = apart.extend(seqs[1], 1)
        assert torch.equal(new_f, new_a)
        sel[0, 0] = new_f[0]
        got_f = fused.prepare(0, sel, new=NewRows(0, new_f, rows))
        models[0].record(0, new_f, rows)
        models[1].write(apart, 0, new_a, rows)
        got_a = apart.prepare(0, sel)
        for p, got, m in ((fused, got_f, models[0]), (apart, got_a, models[1])):
            assert torch.equal(
                p.gpu_buffer(0)[got.slots.view(-1).long()], m.expected(0, sel.view(-1).tolist())
            )
        addrs.append(int(new_f[0]))
    for p, m in zip((fused, apart), models, strict=True):
        assert_reads(p, m, addrs)
    assert fused.stats()["bytes_in"] <= apart.stats()["bytes_in"]
    assert fused.stats()["misses"] <= apart.stats()["misses"]


# --------------------------------------------------------------------------------------------------
# 3. refusals change nothing; a plan stopped after any phase loses nothing


def loaded(policy=None):
    pool = tiered(policy or ExactLRU(), gpu=4, cpu=20)
    model = RowModel(WIDTH)
    seq = pool.admit(6)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=8)
    return pool, model, seq, addrs


BAD_NEW = {
    "new-token-already-homed": lambda addrs, new: torch.tensor([addrs[0], int(new[0])]),
    "twice-among-the-new": lambda addrs, new: torch.tensor([int(new[0]), int(new[0])]),
    "out-of-range": lambda addrs, new: torch.tensor([int(new[0]), 10_000]),
}


@pytest.mark.parametrize("case", list(BAD_NEW), ids=list(BAD_NEW))
def test_a_refused_one_plan_changes_nothing(case) -> None:
    pool, _model, seq, addrs = loaded()
    new = pool.extend(seq, 2)
    bad = BAD_NEW[case](addrs, new)
    call = lambda: pool.prepare(
        0, addr_tensor(addrs[:2]).view(1, 2), new=NewRows(0, bad, random_rows(1, 2, WIDTH))
    )
    expect_rejected(pool, InvalidAddressError, call, addrs)
    # and the pool serves the next call as before
    pool.prepare(0, addr_tensor(addrs[:2]).view(1, 2), new=NewRows(0, new, random_rows(2, 2, WIDTH)))
    pool.check_invariants()


def test_a_refused_one_plan_is_raised_by_the_next_call_when_not_validating() -> None:
    """Validation off (the CUDA default): the refusal is reported in the report word, nothing
    changed, and the next call raises it, naming a prepare."""
    pool, _model, seq, addrs = loaded()
    pool.internals().validate = False
    new = pool.extend(seq, 2)
    before = pool.state_dict()
    bad = torch.tensor([addrs[0], int(new[0])])
    pool.prepare(0, addr_tensor(addrs[:2]).view(1, 2), new=NewRows(0, bad, random_rows(1, 2, WIDTH)))
    assert_same_state(before, pool.state_dict(), ignore=("stats", "pending"))
    with pytest.raises(InvalidAddressError, match="prepare"):
        pool.prepare(0, addr_tensor(addrs[:1]).view(1, 1))


@pytest.mark.parametrize(
    "bad",
    ["other-groups-layer", "not-new-rows", "rows-shape", "addresses-2d"],
)
def test_bad_new_rows_are_refused_before_anything_runs(bad) -> None:
    pool = tiered(ExactLRU(), gpu=4, cpu=20, per_group=1, layers=2)
    seq = pool.admit(4)
    new = pool.extend(seq, 2)
    rows = random_rows(1, 2, WIDTH)
    arg = {
        "other-groups-layer": NewRows(1, new, rows),
        "not-new-rows": (0, new, rows),
        "rows-shape": NewRows(0, new, rows[:1]),
        "addresses-2d": NewRows(0, new.view(1, 2), rows),
    }[bad]
    expect_rejected(
        pool,
        InvalidInputError,
        lambda: pool.prepare(0, seq.addresses[:2].view(1, 2), new=arg),
        seq.addresses.tolist(),
    )


@pytest.mark.parametrize("phase", ["out", "evict", "in"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_one_plan_stopped_after_each_phase_loses_nothing(policy, phase) -> None:
    """Stopped after ``phase``: every entry homed before the call reads back as before it, and the
    next call finishes the plan: the state equals an uninterrupted run's, new rows included."""
    pool, model, seq, addrs = loaded(policy)
    new = pool.extend(seq, 2)
    rows = random_rows(3, 2, WIDTH)
    sel = addr_tensor(addrs[4:6]).view(1, 2)  # two on the CPU: with the new tokens, 4 victims
    whole = copy.deepcopy(pool)
    whole.prepare(0, sel, new=NewRows(0, new, rows))
    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted):
        pool.prepare(0, sel, new=NewRows(0, new, rows))
    assert_reads(pool, model, addrs)
    pool.check_invariants()  # finishes the plan first
    assert_same_state(whole.state_dict(), pool.state_dict())
    model.record(0, new, rows)
    assert_reads(pool, model, addrs + new.tolist())


def test_new_rows_with_an_empty_selection_are_one_plan_of_their_own() -> None:
    """An empty selection with new rows plans the new tokens alone: the rows go in, and a token
    that is not new is refused (as with a selection), changing nothing."""
    pool, model, seq, addrs = loaded()
    new = pool.extend(seq, 2)
    rows = random_rows(4, 2, WIDTH)
    empty = torch.empty(1, 0, dtype=torch.int64)
    got = pool.prepare(0, empty, new=NewRows(0, new, rows))
    assert got.slots.shape == (1, 0)
    model.record(0, new, rows)
    assert_reads(pool, model, addrs + new.tolist())
    again = NewRows(0, new[:1], random_rows(5, 1, WIDTH))  # homed now: not new
    expect_rejected(
        pool, InvalidAddressError, lambda: pool.prepare(0, empty, new=again), addrs + new.tolist()
    )


def test_the_refusal_names_what_was_not_new() -> None:
    pool, _model, _seq, addrs = loaded()
    with pytest.raises(InvalidAddressError, match="new row's address already has a home") as caught:
        pool.prepare(
            0,
            addr_tensor(addrs[:1]).view(1, 1),
            new=NewRows(0, addr_tensor(addrs[1:2]), random_rows(1, 1, WIDTH)),
        )
    assert str(caught.value).endswith("nothing changed")


# --------------------------------------------------------------------------------------------------
# 4. free slots, write copies off, many new tokens, the plan as described, any claim order


def assert_same_as_references(pool, group: int, sel: torch.Tensor, new: NewRows) -> torch.Tensor:
    """One plan through the kernels and, on a copy, through their references: the same slots and
    state word for word. Returns the slots."""
    twin = with_references(pool)
    got = pool.prepare(group, sel, new=new)
    want = twin.prepare(group, sel, new=new)
    assert torch.equal(got.slots, want.slots)
    assert_same_state(pool.state_dict(), twin.state_dict())
    return got.slots


@pytest.mark.parametrize("policy", POLICIES)
def test_new_tokens_take_the_free_slots_first(policy) -> None:
    """With free GPU slots, new tokens are the call's first misses: they take the top of the free
    stack before the selection's misses, and nothing is evicted."""
    pool = tiered(policy, gpu=12, cpu=40)
    model = RowModel(WIDTH)
    seq = pool.admit(6)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=6)
    free_top = (
        pool.internals()
        .state.gpu_free[0, : int(pool.internals().state.gctl[0, int(K.G_GPU_FREE)])]
        .flip(0)
        .tolist()
    )
    new = pool.extend(seq, 3)
    rows = random_rows(7, 3, WIDTH)
    s0 = pool.stats()
    assert_same_as_references(pool, 0, addr_tensor(addrs[:4]).view(1, 4), NewRows(0, new, rows))
    model.record(0, new, rows)
    assert pool.residency(0, new).tolist() == free_top[:3]
    assert deltas(s0, pool.stats())["victims"] == 0
    assert_reads(pool, model, addrs + new.tolist())


@pytest.mark.parametrize("policy", POLICIES)
def test_one_plan_without_write_copies_makes_none(policy) -> None:
    """``Tiered(write_copies=False)``: new tokens get no copy (no bytes out for them), kernels and
    references alike, and their later eviction copies their rows out."""
    pool = tiered(policy, gpu=4, cpu=40, write_copies=False)
    model = RowModel(WIDTH)
    seq = pool.admit(8)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=3)
    new = pool.extend(seq, 2)
    rows = random_rows(8, 2, WIDTH)
    s0 = pool.stats()
    on_cpu = [a for a in addrs if int(pool.residency(0, addr_tensor([a]))[0]) < 0]
    assert_same_as_references(pool, 0, addr_tensor(on_cpu[:2]).view(1, 2), NewRows(0, new, rows))
    model.record(0, new, rows)
    assert not set(new.tolist()) & set(copies(pool, 0))
    d = deltas(s0, pool.stats())
    assert d["bytes_out"] == (d["victims"] - d["clean_evictions"]) * row_bytes(pool, 0)
    assert_reads(pool, model, addrs + new.tolist())


def test_many_new_tokens_span_chunks_and_a_repeat_across_chunks_is_refused() -> None:
    """1,100 new tokens (two chunks of the claim) with a selection naming one in the second chunk:
    kernels and references agree; the same address twice among the new, in different chunks, is
    refused."""
    pool = tiered(ExactLRU(), gpu=1200, cpu=1300)
    model = RowModel(WIDTH)
    seq = pool.admit(50)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=9)
    new = pool.extend(seq, 1100)
    rows = random_rows(10, 1100, WIDTH)
    twice = new.clone()
    twice[1050] = twice[3]
    expect_rejected(
        pool,
        InvalidAddressError,
        lambda: pool.prepare(0, addr_tensor(addrs[:3]).view(1, 3), new=NewRows(0, twice, rows)),
        addrs,
    )
    sel = addr_tensor([addrs[0], int(new[1070]), -1, addrs[7]]).view(2, 2)
    slots = assert_same_as_references(pool, 0, sel, NewRows(0, new, rows))
    model.record(0, new, rows)
    assert int(slots[0, 1]) == int(pool.residency(0, new[1070:1071])[0])
    assert_reads(pool, model, addrs + new.tolist())


@pytest.mark.parametrize("policy", POLICIES)
def test_describe_names_each_new_tokens_copy(policy) -> None:
    """``TransferPlan.describe()`` of a one-plan call: positions count in the plan's addresses (the
    new tokens first), the new tokens are the first misses, each with the row its copy takes, and
    the selection's misses take none."""
    pool = tiered(policy, gpu=4, cpu=40)
    model = RowModel(WIDTH)
    seq = pool.admit(8)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=1)
    on_cpu = [a for a in addrs if int(pool.residency(0, addr_tensor([a]))[0]) < 0]
    new = pool.extend(seq, 2)
    plan = pool.plan(0, addr_tensor(on_cpu[:2]).view(1, 2), new=NewRows(0, new, random_rows(2, 2, WIDTH)))
    moves = plan.describe()
    assert moves["position"].tolist() == [0, 1, 2, 3]
    assert moves["address"].tolist() == [*new.tolist(), *on_cpu[:2]]
    assert (moves["copy_row"][:2] >= 0).all() and (moves["copy_row"][2:] == -1).all()
    pool.run(plan)
    assert [copies(pool, 0)[a] for a in new.tolist()] == moves["copy_row"][:2].tolist()


def test_a_repeat_among_the_new_is_refused_whichever_position_claims_first() -> None:
    """On a GPU the claims of one address race; the interpreter runs the lower position first. A
    claim word planted as if the later position had claimed first: a repeat among the new tokens
    is still refused, and a selection's occurrence of a new token that claimed first is not a
    repeat."""
    pool, model, seq, addrs = loaded()
    new = pool.extend(seq, 3)
    epoch = int(pool.internals().state.ctl[int(K.E_EPOCH)])
    key = lambda pos: (epoch << 32) | (int(K.POS_MASK) - pos)
    twice = new.clone()
    twice[2] = twice[0]  # positions 0 and 2 among the new
    pool.internals().state.claim[int(twice[0])] = key(2)  # position 2 claimed first
    expect_rejected(
        pool,
        InvalidAddressError,
        lambda: pool.prepare(
            0, addr_tensor(addrs[:1]).view(1, 1), new=NewRows(0, twice, random_rows(3, 3, WIDTH))
        ),
        addrs,
    )
    epoch = int(pool.internals().state.ctl[int(K.E_EPOCH)])
    sel = addr_tensor([addrs[0], int(new[1])]).view(1, 2)  # element 3 + 1 = position 4 names new[1]
    pool.internals().state.claim[int(new[1])] = key(3 + 1)  # the selection's occurrence claimed first
    rows = random_rows(4, 3, WIDTH)
    pool.prepare(0, sel, new=NewRows(0, new, rows))
    model.record(0, new, rows)
    assert_reads(pool, model, addrs + new.tolist())


def test_the_adapter_refuses_more_new_tokens_than_it_reserved() -> None:
    """``SparseKV`` reserves scratch for a new token a query position of ``max_batch``: more would
    take scratch of their own at every step (a captured step must not), so they are refused."""
    pool, _model, seq, addrs = loaded()
    kv = SparseKV(pool, max_batch=2, top_k=2)
    new = pool.extend(seq, 3)
    expect_rejected(
        pool,
        InvalidInputError,
        lambda: kv.prepare(
            0, addr_tensor(addrs[:2]).view(1, 2), new=NewRows(0, new, random_rows(1, 3, WIDTH))
        ),
        addrs,
    )
    kv.prepare(0, addr_tensor(addrs[:2]).view(1, 2), new=NewRows(0, new[:2], random_rows(1, 2, WIDTH)))


def test_max_selection_counts_the_new_tokens() -> None:
    """Four GPU slots: three selected entries and two new tokens cannot all be on the GPU at once,
    so the one plan is refused, changing nothing; three and one fit."""
    pool, model, seq, addrs = loaded()
    new = pool.extend(seq, 2)
    sel = addr_tensor(addrs[:3]).view(1, 3)
    expect_rejected(
        pool,
        CapacityError,
        lambda: pool.prepare(0, sel, new=NewRows(0, new, random_rows(1, 2, WIDTH))),
        addrs,
    )
    rows = random_rows(2, 1, WIDTH)
    pool.prepare(0, sel, new=NewRows(0, new[:1], rows))
    model.record(0, new[:1], rows)
    assert_reads(pool, model, addrs + new[:1].tolist())
