"""What a wrong policy costs to catch and to shrink with ``ulakv.testing``'s machine, timed.

    python benchmarks/planted_policy.py [--unbounded]

A planted bug (a model that evicts the most recently used entry) meets the real thing twice: the
exact LRU model (plain Python, hypothesis's own settings) and the pool's kernels through
``PoolPolicy`` (interpreted without a GPU) under ``kernel_settings()``. ``--unbounded`` adds the
kernels under hypothesis's own settings (100 examples of up to 50 steps, every phase), which is what
a user got before the kernel settings existed: minutes. Each line: seconds until the first failing
example, seconds until the shrunk example was reported, and the steps of that example.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from ulakv import ExactLRU
from ulakv.policies import ExactLRUModel
from ulakv.testing import EvictsMostRecentModel, PolicyMachine, PoolPolicy, kernel_settings


@dataclass
class Clock:
    start: float = 0.0
    first_failure: float | None = None
    examples: int = 0
    steps_of_last_failure: int = 0


CLOCK = Clock()


class Timed(PolicyMachine):
    """A policy machine that notes when its first example fails and how long its last failing
    example was (hypothesis replays the shrunk one last)."""

    gpu_slots = 4

    def __init__(self) -> None:
        super().__init__()
        CLOCK.examples += 1
        self.steps = 0

    def _check_victims(self, *args) -> None:
        """Every write and prepare ends here (a helper, not a rule: overriding a rule would drop it)."""
        self.steps += 1
        try:
            super()._check_victims(*args)
        except AssertionError:
            if CLOCK.first_failure is None:
                CLOCK.first_failure = time.perf_counter()
            CLOCK.steps_of_last_failure = self.steps
            raise

    def make_model(self):
        return EvictsMostRecentModel(self.gpu_slots)


class OnModels(Timed):
    def make_policy(self):
        return ExactLRUModel(self.gpu_slots)


class OnKernels(Timed):
    def make_policy(self):
        return PoolPolicy(ExactLRU(), self.gpu_slots)


def timed(name: str, machine: type[Timed], run: settings) -> None:
    global CLOCK
    CLOCK = Clock(start=time.perf_counter())
    try:
        run_state_machine_as_test(machine, settings=run)
        outcome = "not caught"
    except AssertionError:
        outcome = "caught"
    done = time.perf_counter() - CLOCK.start
    caught = "-" if CLOCK.first_failure is None else f"{CLOCK.first_failure - CLOCK.start:.1f}"
    print(
        f"{name:<34} {outcome:<10} first failure {caught:>6} s   reported {done:6.1f} s   "
        f"{CLOCK.examples:4d} programs run   shrunk to {CLOCK.steps_of_last_failure} writes and prepares",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--unbounded", action="store_true", help="also the kernels, hypothesis defaults")
    args = parser.parse_args()
    timed("models, hypothesis defaults", OnModels, settings(database=None, deadline=None))
    timed("kernels, kernel_settings()", OnKernels, kernel_settings(database=None))
    if args.unbounded:
        timed("kernels, hypothesis defaults", OnKernels, settings(database=None, deadline=None))


if __name__ == "__main__":
    main()
