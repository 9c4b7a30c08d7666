"""Property-test an eviction policy, ours or yours, in a few lines.

A *policy* here is any object with this small interface (``ExactLRUModel``, ``PBLRUModel`` and
``PoolPolicy``, the real kernels behind a one-group pool, all have it)::

    gpu_slots: int
    prepare(addresses) -> (hits, misses, victims)   # one round: make the distinct addresses resident
    write(addresses, new) -> (new_on_gpu, victims)  # entries written in the current round
    release(addresses) -> None
    residents() -> set[int]

``PolicyMachine`` drives a policy under test and a reference model with the same random requests
(admit, write, speculative selections with duplicates and padding, release) and checks, after every
step, the invariants of ``docs/design.md`` (section 4):

* 4: nothing selected or written in the current round is evicted in it; a selection ends resident;
* 5: no victim is more recent than an entry kept, at the policy's granularity (``recency_class``:
  exact rounds for LRU, ``min(age, num_buckets)`` for PB-LRU whose cold bucket has no order);
* 7: hits, misses, victims and residents equal the model's, step for step.

Use it like this::

    class CheckMine(PolicyMachine):
        gpu_slots = 6
        def make_policy(self):
            return MyPolicy(6)
        def make_model(self):
            return ExactLRUModel(6)

    TestMine = CheckMine.TestCase  # collected by pytest; examples come from your hypothesis profile

Strategies for pool configurations and selection traces come with it (``pool_configs``,
``selections``, ``trace_specs``).

Test a policy against the models first, then against the kernels. A machine over two plain models
runs about 70 programs a second and reports a planted bug shrunk in 7-10 s; one over ``PoolPolicy``
runs the pool's kernels (interpreted without a GPU: ~0.1 s a step), so give it
``kernel_settings()``, which bounds what a failure costs to find and to shrink (the same bug: 46-88 s
against 340 s, ``benchmarks/planted_policy.py``)::

    TestMine.settings = kernel_settings()  # or kernel_settings(max_examples=50)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from .address_space import Sequence
from .config import PBLRU, EntrySpec, ExactLRU, PoolConfig, Tiered
from .policies.exact_lru import ExactLRUModel
from .policies.protocol import TraceProtocol
from .pool import Pool
from .traces import SyntheticSpec

# What a kernel-backed example costs without a GPU, where each of its steps is one or two launches of
# the interpreted kernels (0.05-0.3 s): a program of 8 steps runs in about a second, and a shrink
# replays such programs a few hundred times (benchmarks/planted_policy.py times a planted bug).
KERNEL_STEPS = 8
KERNEL_EXAMPLES = 25
# Far above an interpreted example (a second or two), and above a GPU's first example, which compiles
# every kernel variant it meets (~10 s); an example this slow is a hang or a recompile per call.
KERNEL_DEADLINE = timedelta(seconds=60)


def kernel_settings(**changes) -> settings:
    """Hypothesis settings for property tests whose examples run the pool's kernels, on top of the
    profile loaded (its seed, database and health checks):

    * few examples (``KERNEL_EXAMPLES``) of short programs (``KERNEL_STEPS`` steps): every shrink
      attempt replays a whole program, so its length bounds what shrinking costs;
    * a deadline that fits the interpreter (``KERNEL_DEADLINE``);
    * no targeting and no explain phase (both rerun programs; the explain phase replays the failure
      once per step to say which steps matter), and only the first distinct failure is shrunk.

    ``changes`` override any of them: ``kernel_settings(max_examples=50)``. As a named profile it is
    ``"ulakv-kernels"`` (``settings.load_profile("ulakv-kernels")``), built over the profile loaded
    when ``ulakv.testing`` was first imported."""
    slow = (HealthCheck.too_slow, HealthCheck.data_too_large)  # added to what the profile suppresses
    kernel = {
        "max_examples": KERNEL_EXAMPLES,
        "stateful_step_count": KERNEL_STEPS,
        "deadline": KERNEL_DEADLINE,
        "phases": (Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
        "report_multiple_bugs": False,
        "suppress_health_check": tuple({*settings.default.suppress_health_check, *slow}),
    }
    return settings(**{**kernel, **changes})


settings.register_profile("ulakv-kernels", kernel_settings())


class PoolPolicy:
    """The pool's own kernels seen as a policy: a one-group, one-layer pool whose CPU tier holds
    everything, translated from the caller's addresses to the pool's.

    It takes the trace ``ulakv.policies.protocol`` states, as the models do, and refuses one off it
    with the same ulakv error and words, changing nothing::

        policy = PoolPolicy(ExactLRU(), gpu_slots=4)
        policy.write([10, 11, 12], new={10, 11, 12})  # one batch admitted and written
        hits, misses, victims = policy.prepare([10, 12, -1])
        policy.release([10, 11, 12])  # the whole batch
        policy.prepare([10])  # InvalidAddressError: never written, or released
    """

    def __init__(self, policy: ExactLRU | PBLRU, gpu_slots: int, capacity: int = 512) -> None:
        self.gpu_slots = gpu_slots
        self.pool = Pool(
            PoolConfig(
                entry=EntrySpec(bytes_per_layer=4),
                num_layers=1,
                layout=Tiered(gpu_slots=gpu_slots, cpu_slots=capacity, policy=policy),
            )
        )
        self.trace = TraceProtocol(type(self).__name__, gpu_slots)
        self._to_pool: dict[int, int] = {}
        self._seqs: dict[int, Sequence] = {}  # first address of an admitted batch -> its Sequence

    def _resident_pool(self) -> dict[int, bool]:
        ids = list(self._to_pool)
        if not ids:
            return {}
        slots = self.pool.residency(0, torch.tensor([self._to_pool[i] for i in ids])).tolist()
        return {i: s >= 0 for i, s in zip(ids, slots, strict=True)}

    def residents(self) -> set[int]:
        return {i for i, on_gpu in self._resident_pool().items() if on_gpu}

    def write(self, addresses: list[int], new: set[int]) -> tuple[list[int], list[int]]:
        addresses = list(addresses)
        fresh = self.trace.check_write(addresses, new)
        seq = self.pool.admit(len(fresh)) if fresh else None
        to_pool = {**self._to_pool, **dict(zip(fresh, seq.address_list if seq else [], strict=True))}
        before = self.residents()
        targets = torch.tensor([to_pool.get(a, -1) for a in addresses], dtype=torch.int64)  # -1: padding
        try:
            self.pool.write(0, targets, torch.zeros((len(addresses), 4), dtype=torch.uint8))
        except Exception:
            if seq is not None:  # the pool left itself as it was; so does the policy
                self.pool.release(seq)
            raise
        self._to_pool = to_pool
        if seq is not None:
            self._seqs[fresh[0]] = seq
        self.trace.admit(fresh)
        after = self.residents()
        return [a for a in fresh if a in after], sorted(before - after)

    def prepare(self, addresses: list[int]) -> tuple[list[int], list[int], list[int]]:
        addresses = list(addresses)
        selected = self.trace.check_prepare(addresses)
        before = self.residents()
        sel = torch.tensor([[self._to_pool[a] if a != -1 else -1 for a in addresses]], dtype=torch.int64)
        self.pool.prepare(0, sel)
        after = self.residents()
        hits = [a for a in selected if a in before]
        return hits, [a for a in selected if a not in before], sorted(before - after)

    def release(self, addresses: list[int]) -> None:
        addresses = list(addresses)
        self.trace.check_release(addresses)
        first = self.trace.batch_of[addresses[0]]
        self.pool.release(self._seqs[first])
        del self._seqs[first]
        self.trace.release(addresses)
        for a in addresses:
            del self._to_pool[a]


class EvictsMostRecentModel(ExactLRUModel):
    """A wrong policy on purpose: exact LRU that evicts the most recently used entry not protected in
    the round. Plant it as the policy (or the model) of a test of yours to check that the test fails
    on a wrong policy, and how long it takes to say so (``benchmarks/planted_policy.py``)."""

    def _evict(self, count: int, protected: set[int]) -> list[int]:
        order = [a for a, used in reversed(self.order.items()) if a not in protected and used != self.round]
        for a in order[:count]:
            del self.order[a]
        return order[:count]


def pool_configs(max_gpu_slots: int = 64, policies=None) -> st.SearchStrategy[PoolConfig]:
    """Small valid tiered pool configurations (any policy), for tests of code that builds pools."""
    policy = policies or st.one_of(st.just(ExactLRU()), st.builds(PBLRU, st.integers(2, 8)))
    return st.builds(
        lambda width, layers, per_group, gpu, cpu, pol: PoolConfig(
            entry=EntrySpec(bytes_per_layer=width),
            num_layers=layers,
            layers_per_group=min(per_group, layers),
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=pol),
        ),
        st.integers(1, 48),
        st.integers(1, 4),
        st.integers(1, 4),
        st.integers(1, max_gpu_slots),
        st.integers(0, 4 * max_gpu_slots),
        policy,
    )


@st.composite
def selections(draw, live: list[int], max_distinct: int, max_queries: int = 3, k: int = 8) -> list[int]:
    """A flattened ``[queries, k]`` selection over ``live`` addresses: at most ``max_distinct``
    distinct ones, overlapping query positions, duplicates and -1 padding."""
    pool = draw(st.lists(st.sampled_from(live), min_size=1, max_size=max_distinct, unique=True))
    queries = draw(st.integers(1, max_queries))
    return [draw(st.sampled_from([*pool, -1])) for _ in range(queries * k)]


def trace_specs(max_requests: int = 4, max_steps: int = 8) -> st.SearchStrategy[SyntheticSpec]:
    """Small synthetic-trace specifications (feed them to ``ulakv.traces.synthetic``)."""
    return st.builds(
        SyntheticSpec,
        requests=st.integers(1, max_requests),
        prompt=st.tuples(st.integers(16, 64), st.integers(64, 128)),
        steps=st.integers(1, max_steps),
        topk=st.sampled_from([8, 16, 32]),
        queries=st.integers(1, 3),
        groups=st.integers(1, 3),
        window=st.integers(0, 8),
        heavy=st.integers(0, 8),
        drift=st.floats(0, 0.5),
        far_reuse=st.floats(0, 1),
        group_overlap=st.floats(0, 1),
        query_overlap=st.floats(0, 1),
        arrival_spread=st.integers(0, 4),
        seed=st.integers(0, 2**16),
    )


def exact_ages(age: int) -> int:
    return age


class PolicyMachine(RuleBasedStateMachine):
    """Checks a policy against a model and invariants 4, 5, 7 (see the module docstring).
    Subclass it, set ``gpu_slots``, and define ``make_policy``, ``make_model`` and, for a policy
    coarser than exact LRU, ``recency_class``.

    Every rule can run at every step (there is always an admitted batch: a release of the last one
    admits a fresh one), so hypothesis never redraws a rule whose precondition fails; with a
    release that needed two batches, 85 % of programs had redrawn one and 5 % were given up."""

    gpu_slots = 6
    # Subclasses define make_policy() and make_model(), each returning a policy object.

    recency_class: Callable[[int], int] = staticmethod(exact_ages)

    def __init__(self) -> None:
        super().__init__()
        if not (hasattr(self, "make_policy") and hasattr(self, "make_model")):
            raise TypeError(f"{type(self).__name__} must define make_policy() and make_model()")
        self.policy = self.make_policy()
        self.model = self.make_model()
        self.batches: list[list[int]] = []
        self.next_address = 0
        self.round = 0
        self.last_use: dict[int, int] = {}  # address -> round it was last selected or written on GPU

    @initialize(n=st.integers(1, 12))
    def start(self, n: int) -> None:
        self._admit(n)

    def _admit(self, n: int) -> None:
        batch = list(range(self.next_address, self.next_address + n))
        self.next_address += n
        self.batches.append(batch)
        self._write(batch, set(batch))

    def _write(self, addresses: list[int], new: set[int]) -> None:
        before = self.policy.residents()
        got = self.policy.write(addresses, new)
        want = self.model.write(addresses, new)
        assert sorted(got[0]) == sorted(want[0]), f"new entries homed on the GPU: {got[0]} != {want[0]}"
        self._check_victims(sorted(got[1]), sorted(want[1]), before, set(addresses))
        for a in addresses:
            if a in self.policy.residents():
                self.last_use[a] = self.round

    def _check_victims(self, got: list[int], want: list[int], before: set[int], used: set[int]) -> None:
        assert got == want, f"victims {got} != model's {want}"  # invariant 7
        used_now = {a for a, r in self.last_use.items() if r == self.round} | used
        assert not set(got) & used_now, f"evicted {set(got) & used_now}, used this round"  # invariant 4
        kept = (before - set(got)) - used_now
        if got and kept:  # invariant 5
            victim_class = min(self.recency_class(self.round - self.last_use[a]) for a in got)
            kept_class = max(self.recency_class(self.round - self.last_use[a]) for a in kept)
            assert victim_class >= kept_class, f"evicted class {victim_class} while class {kept_class} stayed"

    @rule(n=st.integers(1, 8))
    def admit(self, n: int) -> None:
        self._admit(n)

    @rule(data=st.data())
    def write_again(self, data) -> None:
        batch = data.draw(st.sampled_from(self.batches))
        addresses = data.draw(st.lists(st.sampled_from(batch), min_size=1, max_size=4, unique=True))
        self._write(addresses, set())

    @rule(data=st.data())
    def prepare(self, data) -> None:
        live = [a for b in self.batches for a in b]
        sel = data.draw(selections(live, self.policy.gpu_slots))
        before = self.policy.residents()
        self.round += 1
        got = self.policy.prepare(sel)
        want = self.model.prepare(sel)
        assert list(got[0]) == list(want[0]) and list(got[1]) == list(want[1]), (
            f"hits/misses {got[:2]} != {want[:2]}"
        )
        selected = {a for a in sel if a != -1}
        self._check_victims(sorted(got[2]), sorted(want[2]), before, selected)
        assert selected <= self.policy.residents(), "a selected address is not resident after prepare"
        for a in selected:
            self.last_use[a] = self.round

    @rule(data=st.data())
    def release(self, data) -> None:
        batch = self.batches.pop(data.draw(st.integers(0, len(self.batches) - 1)))
        self.policy.release(batch)
        self.model.release(batch)
        for a in batch:
            self.last_use.pop(a, None)
        if not self.batches:  # everything released: the policy starts afresh (invariant 6); go on
            self._admit(data.draw(st.integers(1, 12)))

    @invariant()
    def same_residents(self) -> None:
        assert self.policy.residents() == self.model.residents()  # invariant 7
