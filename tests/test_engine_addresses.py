"""Engine-owned addresses (``PoolConfig.engine_addresses``): the engine's token slots are the pool's
logical addresses.

The state machine plays an engine like SGLang: its own allocator hands out slots (never slot 0, the
engine's padding slot; not lowest-first), requests share cached prefixes (one slot, one entry, read
by every request that shares it), a slot is given back when no request holds it any more. Every step
the pool must agree with the model bit for bit through the slots ``prepare`` returns, the live count
must match, and ``check_invariants`` must pass; bad input (a slot live twice, given back twice, out
of range, more live slots than the pool holds) raises and leaves ``state_dict()`` bit-identical.
The kernel is compared with its reference model on the same calls.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_state, row_of
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ulakv import CapacityError, InvalidAddressError, InvalidInputError, Pool
from ulakv.address_space import EngineAddresses
from ulakv.config import EntrySpec, ExactLRU, PoolConfig, Tiered
from ulakv.kernels.engine_addresses import engine_addresses, engine_addresses_reference
from ulakv.layouts.tiered_state import TieredState
from ulakv.testing import kernel_settings


def engine_pool(gpu: int, cpu: int, space: int, layers: int = 2, per_group: int = 1, **kwargs) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=8),
            num_layers=layers,
            layers_per_group=per_group,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=ExactLRU()),
            engine_addresses=space,
            **kwargs,
        )
    )


class EngineMachine(RuleBasedStateMachine):
    @initialize(gpu=st.integers(3, 8), cpu=st.integers(0, 12), layers=st.integers(1, 3), data=st.data())
    def build(self, gpu: int, cpu: int, layers: int, data: st.DataObject) -> None:
        per_group = data.draw(st.integers(1, layers), label="layers_per_group")
        self.cap = gpu + cpu
        self.space = data.draw(st.integers(self.cap + 1, 2 * self.cap + 3), label="engine_addresses")
        self.pool = engine_pool(gpu, cpu, self.space, layers, per_group)
        self.layers = layers
        self.requests: list[list[int]] = []  # each request's slots, in position order
        self.holders: dict[int, int] = {}  # live slot -> how many requests hold it
        self.generation: dict[int, int] = {}  # live slot -> its life (rows differ per life)
        self.lives = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _free_slots(self) -> list[int]:
        return [a for a in range(1, self.space) if a not in self.holders]

    def _write_new(self, slots: list[int]) -> None:
        for layer in range(self.layers):
            rows = torch.stack([row_of(a, layer, self.generation[a], 8) for a in slots])
            self.pool.write(layer, torch.tensor(slots), rows)

    def _expect_refused(self, error: type[Exception], call) -> None:
        before = self.pool.state_dict()
        with pytest.raises(error):
            call()
        assert_same_state(before, self.pool.state_dict())

    # -- rules -----------------------------------------------------------------------------------
    @rule(n=st.integers(1, 5), share=st.integers(0, 4), pad=st.booleans(), data=st.data())
    def new_request(self, n: int, share: int, pad: bool, data: st.DataObject) -> None:
        prefix: list[int] = []
        if self.requests and share:
            parent = data.draw(st.sampled_from(self.requests), label="shares a prefix of")
            prefix = parent[: min(share, len(parent))]
        free = self._free_slots()
        n = min(n, len(free), self.cap - len(self.holders))
        if n == 0 and not prefix:
            return
        new = data.draw(st.permutations(free), label="engine order")[:n] if n else []
        given = list(new)
        if pad:  # padding rows of a captured batch
            given.insert(data.draw(st.integers(0, len(given)), label="pad at"), -1)
        self.pool.admit_addresses(torch.tensor(given, dtype=torch.int32))
        for a in new:
            self.lives += 1
            self.generation[a] = self.lives
            self.holders[a] = 0
        if new:
            self._write_new(new)
        for a in prefix + new:
            self.holders[a] += 1
        self.requests.append(prefix + new)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        seq = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1), label="finishes"))
        gone = []
        for a in seq:
            self.holders[a] -= 1
            if self.holders[a] == 0:
                gone.append(a)
                del self.holders[a]
        if gone:
            order = data.draw(st.permutations(gone), label="free order")
            self.pool.release_addresses(torch.tensor([*order, -1], dtype=torch.int64))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        group = data.draw(st.integers(0, self.pool.num_groups - 1), label="group")
        live = sorted(self.holders)
        limit = self.pool.config.layout.max_selection
        chosen = data.draw(
            st.lists(st.sampled_from(live), min_size=1, max_size=limit, unique=True), label="top-k"
        )
        B = data.draw(st.integers(1, 3), label="batch")
        flat = chosen + [-1] * (-len(chosen) % B)
        topk = torch.tensor(flat).view(B, -1)
        slots = self.pool.prepare(group, topk).slots
        for layer in self.pool.group_layers(group):
            buf = self.pool.gpu_buffer(layer)
            for a, s in zip(topk.flatten().tolist(), slots.flatten().tolist(), strict=True):
                if a == -1:
                    assert s == -1
                else:
                    assert torch.equal(buf[s], row_of(a, layer, self.generation[a], 8)), (a, layer)

    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        live = sorted(self.holders)
        free = self._free_slots()
        cases = ["out of range", "negative"]
        if live:
            cases += ["admit live", "release twice"]
        if free:
            cases += ["release free"]
        if len(free) >= 1:
            cases += ["admit duplicate"]
        if len(free) > self.cap - len(self.holders):
            cases += ["admit too many"]
        case = data.draw(st.sampled_from(cases), label="bad input")
        event(f"bad input: {case}")
        pool = self.pool
        if case == "out of range":
            call = pool.admit_addresses if data.draw(st.booleans()) else pool.release_addresses
            self._expect_refused(InvalidAddressError, lambda: call(torch.tensor([self.space])))
        elif case == "negative":
            self._expect_refused(InvalidAddressError, lambda: pool.admit_addresses(torch.tensor([-2])))
        elif case == "admit live":
            a = data.draw(st.sampled_from(live))
            ok = [f for f in free[:1]]
            self._expect_refused(InvalidAddressError, lambda: pool.admit_addresses(torch.tensor([*ok, a])))
        elif case == "release twice":
            a = data.draw(st.sampled_from(live))
            self._expect_refused(InvalidAddressError, lambda: pool.release_addresses(torch.tensor([a, a])))
        elif case == "release free":
            a = data.draw(st.sampled_from(free))
            self._expect_refused(InvalidAddressError, lambda: pool.release_addresses(torch.tensor([a])))
        elif case == "admit duplicate":
            a = data.draw(st.sampled_from(free))
            self._expect_refused(InvalidAddressError, lambda: pool.admit_addresses(torch.tensor([a, -1, a])))
        else:
            room = self.cap - len(self.holders)
            self._expect_refused(CapacityError, lambda: pool.admit_addresses(torch.tensor(free[: room + 1])))

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def books_agree(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.stats()["live_addresses"] == len(self.holders)
        assert self.pool.free_addresses == self.cap - len(self.holders)


TestEngineMachine = EngineMachine.TestCase
# The kernel profile: 25 programs of 8 steps, 8.5 s alone (a write per layer per request,
# interpreted). In CI's derandomized run every bad-input case comes up (`--hypothesis-show-statistics`,
# 2026-12-07: out of range in 21 of 30 programs, admit duplicate 15, negative 7, release free 7, admit
# too many 5, admit live 2, release twice 2); 25 of 12 steps took 15 s and reached fewer (11, 4, 7, 8,
# 5, 2, 1 of 43).
TestEngineMachine.settings = kernel_settings()


@pytest.mark.parametrize("admit", [True, False], ids=["admit", "release"])
@pytest.mark.parametrize(
    "addrs",
    [[3, 5, -1, 9], [3, 3], [0, 16], [-1, -1], [16], [-2, 4], [1, 2, 4, 6, 7, 8, 10, 11, 12, 13]],
    ids=["ok", "dup", "edge", "padding", "range", "negative", "many"],
)
def test_kernel_equals_reference(admit: bool, addrs: list[int]) -> None:
    """The kernel and its reference model give the same status, mapping and live count."""
    config = PoolConfig(
        EntrySpec(8), num_layers=3, layers_per_group=2, layout=Tiered(gpu_slots=4, cpu_slots=5)
    )
    states, books = [], []
    for _ in range(2):
        st_ = TieredState.allocate(config, addresses=16)
        st_.mapping[:, [4, 6, 9, 15]] = torch.tensor([-2, 0, 5, 1], dtype=torch.int32)  # live already
        states.append(st_)
        book = EngineAddresses(9, st_.mapping, torch.zeros(1, dtype=torch.int64))
        book.live[0] = 4
        books.append(book)
    addr = torch.tensor(addrs, dtype=torch.int64)
    engine_addresses(addr, states[0], books[0], admit)
    engine_addresses_reference(addr, states[1], books[1], admit)
    assert torch.equal(states[0].mapping, states[1].mapping)
    assert torch.equal(books[0].live, books[1].live)
    assert torch.equal(books[0].ctl, books[1].ctl)
    assert torch.equal(books[0].report, books[1].report)
    assert torch.equal(states[0].ctl, TieredState.allocate(config, addresses=16).ctl), "no call word"


def test_deferred_refusal_raises_at_the_next_call_and_changes_nothing() -> None:
    """Without validation (the CUDA default) a refused admission changes nothing and its error is
    raised by the next call, which then runs."""
    pool = engine_pool(4, 4, 20, validate=False)
    pool.admit_addresses(torch.tensor([2, 3]))
    before = pool.state_dict()
    pool.admit_addresses(torch.tensor([3, 4]))  # 3 is live: refused on the device, no raise yet
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    with pytest.raises(InvalidAddressError, match="an earlier"):
        pool.admit_addresses(torch.tensor([4]))
    pool.admit_addresses(torch.tensor([4]))
    assert pool.stats()["live_addresses"] == 3


def test_pool_owned_calls_are_refused_and_the_reverse() -> None:
    engine = engine_pool(4, 0, 8)
    with pytest.raises(InvalidInputError, match="belong to the engine"):
        engine.admit(2)
    owned = Pool(PoolConfig(EntrySpec(8), num_layers=1, layout=Tiered(gpu_slots=4)))
    with pytest.raises(InvalidInputError, match="engine_addresses"):
        owned.admit_addresses(torch.tensor([1]))
    with pytest.raises(InvalidInputError, match="1-D"):
        engine.admit_addresses(torch.tensor([[1]]))


def test_caller_views_are_read_in_place() -> None:
    """Addresses given as a strided view of a wider tensor (a column of a batch table)."""
    pool = engine_pool(4, 4, 32)
    table = torch.arange(40, dtype=torch.int64).view(8, 5)  # column 1: 1, 6, 11, ..., 36
    pool.admit_addresses(table[:6, 1])
    assert pool.stats()["live_addresses"] == 6
    pool.release_addresses(table[:6:2, 1])
    assert pool.free_addresses == 8 - 3
    pool.check_invariants()
