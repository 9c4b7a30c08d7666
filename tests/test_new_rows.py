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
from test_clean_evictions import POLICIES, POLICY_IDS, copies, deltas, row_bytes
from test_clean_evictions import tiered as tiered_pool

from ulakv import ExactLRU, NewRows
from ulakv.errors import InvalidAddressError, InvalidInputError
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
    twin._layout.kernels = REFERENCE
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
    ("pblru3-1-layer-groups", 5, 40, 2, 1, POLICIES[1]),
    ("pblru3-2-layer-group", 4, 40, 3, 2, POLICIES[1]),
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


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_one_plan_passes_the_plan_audit(policy, monkeypatch) -> None:
    """Under ``ULAKV_DEBUG=1`` every finished plan is checked against the policy's rules from a
    snapshot taken before it (free slots first, the oldest unprotected victims, nothing selected
    evicted, every element's home, the recency after): one plan's new tokens are misses like any."""
    monkeypatch.setenv("ULAKV_DEBUG", "1")
    pool = tiered(policy, gpu=4, cpu=40)
    assert pool._debug
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


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
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


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
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
    pool._validate = False
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
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
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


def test_new_rows_with_an_empty_selection_are_written() -> None:
    pool, model, seq, addrs = loaded()
    new = pool.extend(seq, 2)
    rows = random_rows(4, 2, WIDTH)
    got = pool.prepare(0, torch.empty(1, 0, dtype=torch.int64), new=NewRows(0, new, rows))
    assert got.slots.numel() == 0
    model.record(0, new, rows)
    assert_reads(pool, model, addrs + new.tolist())


def test_the_refusal_names_what_was_not_new() -> None:
    pool, _model, _seq, addrs = loaded()
    with pytest.raises(InvalidAddressError, match="new row"):
        pool.prepare(
            0,
            addr_tensor(addrs[:1]).view(1, 1),
            new=NewRows(0, addr_tensor(addrs[1:2]), random_rows(1, 1, WIDTH)),
        )
    assert int(K.ST_NOT_NEW) not in (int(K.ST_BAD_ADDRESS), int(K.ST_DUPLICATE), int(K.ST_TOO_LARGE))
