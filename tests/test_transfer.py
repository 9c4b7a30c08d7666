"""Transfer plans: data first, then mapping; a plan stopped between its phases loses nothing.

The pools here are full (every admitted address live), so each swap needs a staging CPU row: the
case where an in-place swap would overwrite a home that the mapping still names.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_state, policy_cases, random_rows

from ulakv import (
    PBLRU,
    CapacityError,
    ConfigError,
    EntrySpec,
    ExactLRU,
    InvalidInputError,
    Pool,
    PoolConfig,
    Tiered,
)
from ulakv.kernels import common as K
from ulakv.transfer import Phase, PlanInterrupted, interrupt_after

G, C, WIDTH, LAYERS, PER_GROUP = 6, 10, 12, 4, 3  # groups of 3 and 1 layers
POLICIES = policy_cases(3)  # 3 buckets: rounds retire buckets within these short tests


def full_pool(
    policy, spare: int = 0, **layout
) -> tuple[Pool, torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """A pool whose every address but ``spare`` is admitted and written, most of them on the CPU."""
    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=WIDTH),
        num_layers=LAYERS,
        layers_per_group=PER_GROUP,
        layout=Tiered(gpu_slots=G, cpu_slots=C, policy=policy, **layout),
    )
    pool = Pool(cfg)
    seq = pool.admit(G + C - spare)
    addrs = seq.addresses
    gen = torch.Generator().manual_seed(11)
    expected = {}
    for layer in range(LAYERS):
        rows = random_rows(gen, addrs.numel(), WIDTH)
        pool.write(layer, addrs, rows)
        for a, row in zip(addrs.tolist(), rows, strict=True):
            expected[(layer, a)] = row
    return pool, addrs, expected


def assert_all_readable(pool: Pool, addrs: torch.Tensor, expected) -> None:
    for layer in range(LAYERS):
        got = pool.read(layer, addrs)
        want = torch.stack([expected[(layer, a)] for a in addrs.tolist()])
        assert torch.equal(got, want), f"layer {layer}: an entry is not readable at its home"


def cpu_resident(pool: Pool, group: int, addrs: torch.Tensor) -> torch.Tensor:
    return addrs[pool.residency(group, addrs) < 0]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("phase", ["out", "evict", "in"])
@pytest.mark.parametrize("group", [0, 1], ids=["3-layer-group", "1-layer-group"])
def test_interrupted_plan_leaves_every_entry_readable_and_next_prepare_succeeds(policy, phase, group) -> None:
    pool, addrs, expected = full_pool(policy)
    # Five CPU-resident entries: five swaps, each evicting an entry of the full GPU tier.
    sel = cpu_resident(pool, group, addrs)[:5].reshape(1, 5)
    homes_before = pool.state_dict()["mapping"][group].clone()

    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted) as info:
        pool.prepare(group, sel)
    assert info.value.phase == Phase[phase.upper()]

    mapping = pool.internals().state.mapping[group]
    if phase == "out":  # data moved, no mapping changed yet
        assert torch.equal(mapping, homes_before)
    else:  # victims moved to the CPU; the selected entries still live on the CPU
        assert torch.equal(mapping[sel.reshape(-1)], homes_before[sel.reshape(-1)])
        assert not torch.equal(mapping, homes_before)
    assert_all_readable(pool, addrs, expected)  # each at the home its mapping names

    # The next call finishes the stopped plan, then runs as usual.
    again = pool.prepare(group, sel)
    pool.check_invariants()
    for layer in pool.group_layers(group):
        got = pool.gpu_buffer(layer)[again.slots.reshape(-1).long()]
        want = torch.stack([expected[(layer, a)] for a in sel.reshape(-1).tolist()])
        assert torch.equal(got, want)
    assert_all_readable(pool, addrs, expected)
    stats = pool.stats()
    assert stats["misses"] == 5 and stats["hits"] == 5  # the second prepare found them resident


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("phase", ["out", "in"])
def test_interrupted_write_is_finished_by_the_next_call(policy, phase) -> None:
    """A write of new tokens into a full GPU tier evicts; stopped after its data moved, the old
    entries stay readable and the next call completes the write."""
    pool, addrs, expected = full_pool(policy, spare=2)
    resident = addrs[pool.residency(0, addrs) >= 0]
    pool.prepare(0, resident[:1].reshape(1, 1))  # a new round: the other GPU entries may go
    victims = pool.stats()["victims"]
    new = pool.admit(2).addresses
    rows = random_rows(torch.Generator().manual_seed(5), 2, WIDTH)
    with interrupt_after(pool, phase), pytest.raises(PlanInterrupted):
        pool.write(0, new, rows)
    assert_all_readable(pool, addrs, expected)
    pool.prepare(1, addrs[:2].reshape(1, 2))  # finishes the write first
    pool.check_invariants()
    assert pool.stats()["victims"] == victims + 2  # the write evicted for its new entries
    assert torch.equal(pool.read(0, new), rows)
    assert torch.equal(pool.read(1, new), torch.zeros_like(rows))  # other layers: not written yet
    assert_all_readable(pool, addrs, expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_phases_run_in_steps_equal_one_run(policy) -> None:
    """An engine's split (out + evict + first layer in; the other layers in + commit) ends in the
    same state, bit for bit, as running the plan at once."""
    whole, addrs, _ = full_pool(policy)
    split, _, _ = full_pool(policy)
    for step in range(3):
        sel = cpu_resident(whole, 0, addrs)[step : step + 4].reshape(2, 2)
        whole.prepare(0, sel)
        plan = split.plan(0, sel)
        split.run(plan, until=Phase.IN, in_layers=range(0, 1))
        assert not plan.finished and plan.layers_in == {0}
        split.run(plan)
        assert plan.finished and plan.layers_in == {0, 1, 2}
        assert_same_state(whole.state_dict(), split.state_dict())
    split.check_invariants()


def test_plan_is_data() -> None:
    """A plan lists its moves: sources are the misses' CPU homes, destinations the slots returned,
    and each victim's CPU row was free before the call."""
    pool, addrs, _ = full_pool(ExactLRU())
    sel = cpu_resident(pool, 0, addrs)[:4].reshape(1, 4)
    before = pool.internals().state.mapping[0].clone()
    plan = pool.plan(0, sel)
    moves = plan.describe()
    assert torch.equal(moves["address"], sel.reshape(-1))
    assert torch.equal(moves["source"], before[sel.reshape(-1)].long())
    live_cpu_rows = set((before[before >= G] - G).tolist())
    assert not live_cpu_rows & set(moves["cpu_row"].tolist())
    pool.run(plan)
    assert torch.equal(plan.slots.long(), moves["gpu_slot"])
    with pytest.raises(InvalidInputError, match="not the pool's latest"):
        pool.run(plan)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_run_carries_out_the_plan_it_is_given(policy) -> None:
    """The plan decides and the run executes: swap two evicting misses' decisions in the plan's
    columns (slot, popped row, the victim's row, flags) and the run follows the edited plan, as
    ``describe()`` shows it, with every entry still readable at its home."""
    pool, addrs, expected = full_pool(policy)
    sel = cpu_resident(pool, 0, addrs)[:2].reshape(1, 2)
    plan = pool.plan(0, sel)
    before = plan.describe()
    assert (before["victim_row"] >= 0).all(), "both misses should evict: the GPU is full"
    moves = plan.scratch.moves
    decided = [int(w) for w in (K.MV_SLOT, K.MV_ROW, K.MV_DEST, K.MV_FLAGS)]
    moves[decided, :2] = moves[decided, :2].flip(1).clone()
    edited = plan.describe()
    assert torch.equal(edited["gpu_slot"], before["gpu_slot"].flip(0))
    owner = pool.internals().state.owner[0].clone()
    pool.run(plan)
    slots = pool.residency(0, sel).view(-1)
    assert torch.equal(slots[edited["position"]].long(), edited["gpu_slot"])
    victims = owner[edited["gpu_slot"]]
    assert torch.equal(pool.internals().state.mapping[0][victims].long() - G, edited["victim_row"])
    pool.check_invariants()
    assert_all_readable(pool, addrs, expected)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_plan_never_run_is_finished_by_the_next_call(policy) -> None:
    """Planning already took slots from the free stacks and the policy: a plan left unrun is run
    by the next call, and a stale plan cannot be run twice."""
    pool, addrs, expected = full_pool(policy)
    sel = cpu_resident(pool, 0, addrs)[:3].reshape(1, 3)
    stale = pool.plan(0, sel)
    pool.prepare(1, cpu_resident(pool, 1, addrs)[:2].reshape(1, 2))  # finishes `stale` first
    assert stale.finished
    assert torch.equal(pool.residency(0, sel), stale.slots)
    with pytest.raises(InvalidInputError, match="not the pool's latest"):
        pool.run(stale)
    pool.check_invariants()
    assert_all_readable(pool, addrs, expected)


def test_commit_needs_every_layer() -> None:
    pool, addrs, _ = full_pool(ExactLRU())
    plan = pool.plan(0, cpu_resident(pool, 0, addrs)[:2].reshape(1, 2))
    with pytest.raises(Exception, match="every layer"):
        pool.run(plan, in_layers=range(0, 1))
    pool.run(plan)
    pool.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_staging_rows_bound_the_selection(policy) -> None:
    """With 3 staging rows a prepare may select 3 distinct addresses; 4 fail and change nothing
    (PB-LRU's lookup touches no bucket for a call the plan will refuse)."""
    pool, addrs, expected = full_pool(policy, staging_slots=3)
    assert pool.config.layout.max_selection == 3
    sel = torch.cat([cpu_resident(pool, 0, addrs)[:2], addrs[pool.residency(0, addrs) >= 0][:2]])
    before = pool.state_dict()
    with pytest.raises(CapacityError, match="staging_slots 3"):
        pool.prepare(0, sel.reshape(1, 4))
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    pool.prepare(0, sel[1:].reshape(1, 3))
    pool.check_invariants()
    assert_all_readable(pool, addrs, expected)


def test_largest_swap_of_a_full_pool() -> None:
    """Every GPU entry swapped out for a CPU one at once: G staging rows in use, nothing lost."""
    pool, addrs, expected = full_pool(PBLRU(2))
    for group in range(pool.num_groups):
        sel = cpu_resident(pool, group, addrs)[:G].reshape(2, G // 2)
        slots = pool.prepare(group, sel).slots
        assert torch.equal(pool.residency(group, sel), slots.reshape(-1))
    pool.check_invariants()
    assert_all_readable(pool, addrs, expected)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(gpu_slots=4, cpu_slots=0, staging_slots=2), "needs a CPU tier"),
        (dict(gpu_slots=4, cpu_slots=3, staging_slots=0), "staging_slots must be >= 1"),
        (dict(gpu_slots=4, cpu_slots=3, staging_slots=1.5), "must be an int"),
    ],
    ids=["no-cpu-tier", "zero-with-cpu", "float"],
)
def test_bad_staging_config(layout, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Tiered(**layout)


def test_staging_defaults() -> None:
    assert Tiered(gpu_slots=8).max_selection == 8 and Tiered(gpu_slots=8).cpu_staging == 0
    assert Tiered(gpu_slots=8, cpu_slots=20).cpu_staging == 8
    assert Tiered(gpu_slots=8, cpu_slots=20, staging_slots=3).max_selection == 3
