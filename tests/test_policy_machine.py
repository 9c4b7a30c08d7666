"""The policy kit on our own policies (the real kernels, through a pool) and on a planted bug."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule, run_state_machine_as_test

from ulakv import PBLRU, ExactLRU
from ulakv.policies import ExactLRUModel, PBLRUModel
from ulakv.testing import EvictsMostRecentModel, PolicyMachine, PoolPolicy, kernel_settings

# The kernel profile (``kernel_settings``): its 25 programs, of 6 steps (invariants 4, 5 and 7 of
# docs/design.md on 5- and 6-slot pools). 200 of 5 took 370 s and 188 s of a 2-core CI's 19 minutes, the
# suite's long pole; test_invariants.py checks the same invariants on 400-slot pools and test_oracles.py
# holds exact LRU to libCacheSim hit for hit. Every step is a plan of the pool's kernels (~0.1 s
# interpreted), and only prepares of entries the GPU does not hold make victims to compare. Prepares with
# victims a run, mean (range) over 8 random runs, against 60 examples of 5 steps without the second prepare
# rule below: exact LRU 21.8 (5-48) in 7.9 s against 19.0 (7-42) in 15.4 s; PB-LRU 17.4 (6-39) in 12.9 s
# against 19.4 (0-30) in 14.9 s (30 examples gave it 13.6). A release of the last batch starts the policy
# afresh (invariant 6), which the machine reaches since release has no precondition.
RUN_LRU = kernel_settings(stateful_step_count=6)
RUN_PBLRU = kernel_settings(stateful_step_count=6)


class MorePrepares(PolicyMachine):
    """The policy kit's machine with a second prepare rule: hypothesis switches rules off at random
    per example (swarm testing), and prepares are the steps that evict."""

    @rule(data=st.data())
    def prepare_again(self, data: st.DataObject) -> None:
        PolicyMachine.prepare(self, data)


class ExactLRUOnPool(MorePrepares):
    gpu_slots = 5

    def make_policy(self):
        return PoolPolicy(ExactLRU(), self.gpu_slots)

    def make_model(self):
        return ExactLRUModel(self.gpu_slots)


class PBLRUOnPool(MorePrepares):
    gpu_slots = 6
    buckets = 3
    # Between rounds the oldest ring bucket has already joined cold, so ages >= buckets - 1 tie.
    recency_class = staticmethod(lambda age: min(age, PBLRUOnPool.buckets - 1))

    def make_policy(self):
        return PoolPolicy(PBLRU(self.buckets), self.gpu_slots)

    def make_model(self):
        return PBLRUModel(self.gpu_slots, self.buckets)


TestExactLRUOnPool = ExactLRUOnPool.TestCase
TestExactLRUOnPool.settings = RUN_LRU
TestPBLRUOnPool = PBLRUOnPool.TestCase
TestPBLRUOnPool.settings = RUN_PBLRU


class CatchesPlantedBug(PolicyMachine):
    gpu_slots = 4

    def make_policy(self):
        return EvictsMostRecentModel(self.gpu_slots)

    def make_model(self):
        return ExactLRUModel(self.gpu_slots)


def test_machine_fails_on_a_planted_bug() -> None:
    # Generation only: shrinking the failing example (7 s of the 7 s) would not change that it fails.
    run = settings(
        max_examples=300, stateful_step_count=10, deadline=None, database=None, phases=[Phase.generate]
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(CatchesPlantedBug, settings=run)


def test_kernel_settings_bound_each_program_and_keep_the_loaded_profile() -> None:
    """The kernel profile changes only what bounds a kernel-backed failure's cost; the loaded
    profile's seed handling stays (CI's derandomized run stays derandomized)."""
    from ulakv.testing import KERNEL_DEADLINE, KERNEL_EXAMPLES, KERNEL_STEPS

    run = kernel_settings(max_examples=7)
    assert (run.max_examples, run.stateful_step_count, run.deadline) == (7, KERNEL_STEPS, KERNEL_DEADLINE)
    assert Phase.shrink in run.phases and not {Phase.explain, Phase.target} & set(run.phases)
    assert not run.report_multiple_bugs
    assert run.derandomize == settings.default.derandomize and run.database == settings.default.database
    assert settings.get_profile("ulakv-kernels").max_examples == KERNEL_EXAMPLES
