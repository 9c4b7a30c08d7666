"""The systems ``ulakv replay`` compares over one trace: ulakv's pool (exact LRU and PB-LRU) and the
CPU-offload baseline at GPU capacities in multiples of one step's working set, beside the Belady
bound; then, at the middle capacity, what real pools hold (distinct entries per physical slot: a
tiered pool, a replicated one, the baseline, and striped ones over gloo ranks).

``SystemComparison(trace, capacities, ...)`` lays the runs out (``steps`` of them in all, for a
progress bar) and ``run(on_step)`` replays them (``ulakv.replay``); the command line only parses
its arguments and prints the result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .config import PBLRU, CPUOffloadBaseline, ExactLRU, LayoutConfig, Replicated, Striped, Tiered
from .errors import InvalidInputError
from .replay import ReplayResult, policy_name, replay
from .traces import Trace


def concurrency(trace: Trace) -> tuple[int, int]:
    """Most requests alive at once, and the most distinct positions one request selects in a
    group-step (what a per-request quota must hold)."""
    alive = max(
        sum(1 for r in trace.requests if r.arrival <= step < r.arrival + r.steps)
        for step in range(trace.horizon)
    )
    largest = 0
    for r in trace.requests:
        for step in range(r.steps):
            for g in range(r.topk.shape[1]):
                picks = r.topk[step, g].flatten()
                largest = max(largest, int(picks[picks >= 0].unique().numel()))
    return alive, largest


@dataclass(frozen=True)
class Run:
    """One replay of the curve: ``x`` times the working set as ``gpu_slots``; ``layout`` None for
    ulakv's ``Tiered`` (or, for the baseline, a quota too small for one request's selection)."""

    x: float
    gpu_slots: int
    label: str
    policy: ExactLRU | PBLRU
    layout: LayoutConfig | None
    fits: bool = True


def row(run: Run, result: ReplayResult | None) -> dict:
    """A curve point as ``ulakv replay --json`` reports it (``None`` figures: the system does not fit)."""
    return {
        "x": run.x,
        "gpu_slots": run.gpu_slots,
        "label": run.label,
        "hit_rate": result.hit_rate if result else None,
        "belady_hit_rate": result.belady_hit_rate if result else None,
        "bytes_in_per_step": result.bytes_in_per_step if result else None,
        "bytes_out_per_step": result.bytes_out_per_step if result else None,
    }


def occupancy_row(label: str, distinct: int, physical: int, hit_rate: float) -> dict:
    return {
        "layout": label,
        "distinct_entries": distinct,
        "physical_slots": physical,
        "distinct_per_slot": round(distinct / physical, 4) if physical else 0.0,
        "hit_rate": hit_rate,
    }


def striped_replay(rank: int, world: int, trace: Trace, buffer: int, buckets: int, attention: str) -> dict:
    """One rank of a striped pool (tensor parallelism) replaying ``trace``: its slice holds a
    ``1/world`` share of the history (GPU part: one step's working set; the rest on the CPU); in
    fetch mode a buffer of ``buffer`` slots beside it, in local mode none."""
    total = sum(r.prompt_len + r.steps for r in trace.requests)
    share = -(-total // world) + len(trace.requests)
    inner = Tiered(gpu_slots=buffer, cpu_slots=share, policy=PBLRU(buckets))
    if attention == "local":
        layout = Striped(world=world, rank=rank, attention="local", inner=inner)
    else:
        layout = Striped(world=world, rank=rank, buffer_slots=buffer, policy=PBLRU(buckets), inner=inner)
    result = replay(trace, PBLRU(buckets), buffer, layout=layout)
    return {
        "hit_rate": result.hit_rate,
        "belady": result.belady_hit_rate,
        "distinct": result.peak_distinct_entries,
        "physical": result.peak_physical_slots,
        "fetched_per_step": result.pool_stats["bytes_communicated"] / result.steps,
    }


class SystemComparison:
    """The runs of one ``ulakv replay``: for each capacity, ulakv under exact LRU and PB-LRU
    (``buckets``) and the CPU-offload baseline (a quota of ``gpu_slots / alive`` a request), replayed
    through ``backend`` (``model`` or ``pool``); at the middle capacity, the real pools' occupancy
    (``Replicated`` over ``world`` ranks; ``Striped`` over ``striped_world`` gloo ranks if > 1)."""

    def __init__(
        self,
        trace: Trace,
        capacities: list[float],
        *,
        buckets: int = 8,
        backend: str = "model",
        world: int = 8,
        striped_world: int = 1,
    ) -> None:
        if not capacities or min(capacities) <= 0:
            raise InvalidInputError(
                f"capacities must be positive multiples of the working set, got {capacities}"
            )
        self.trace, self.buckets, self.backend = trace, buckets, backend
        self.world, self.striped_world = world, striped_world
        self.working = trace.working_set()
        self.alive, self.per_request = concurrency(trace)
        total = sum(r.prompt_len + r.steps for r in trace.requests)
        self.runs: list[Run] = []
        for x in capacities:
            slots = max(1, math.ceil(x * self.working))
            for policy in (ExactLRU(), PBLRU(buckets)):
                self.runs.append(Run(x, slots, f"ulakv, {policy_name(policy)}", policy, None))
            quota = slots // self.alive
            fits = quota >= self.per_request  # else no quota holds one request's selection
            offload = (
                CPUOffloadBaseline(cpu_slots=total, slots_per_request=quota, max_requests=self.alive)
                if fits
                else None
            )
            self.runs.append(Run(x, slots, "CPU offload, per-request LRU", ExactLRU(), offload, fits))
        # Occupancy from real pools (Triton kernels) at one capacity: distinct entries / physical slots.
        self.x_mid = capacities[len(capacities) // 2]
        self.mid = max(1, math.ceil(self.x_mid * self.working))
        quota = self.mid // self.alive
        self.occupancy_runs: list[tuple[str, LayoutConfig]] = [
            ("ulakv (Tiered)", Tiered(gpu_slots=self.mid, cpu_slots=total, policy=PBLRU(buckets))),
            (f"Replicated (world {world})", Replicated(world=world, gpu_slots=total)),
        ]
        if quota >= self.per_request:
            offload = CPUOffloadBaseline(cpu_slots=total, slots_per_request=quota, max_requests=self.alive)
            self.occupancy_runs.append(("CPU offload", offload))

    @property
    def steps(self) -> int:
        """Trace steps the single-process replays run in all (a run that does not fit counts its
        steps, skipped)."""
        return (len(self.runs) + len(self.occupancy_runs)) * self.trace.horizon

    def run(self, on_step: Callable[[int], object] | None = None) -> tuple[list[dict], list[dict]]:
        """Replay every run; returns the curve's rows and the occupancy rows. ``on_step(n)``: ``n``
        more steps done (a progress bar's ``update``)."""
        tick = on_step or (lambda n: None)
        rows = []
        for run in self.runs:
            if not run.fits:
                tick(self.trace.horizon)
                rows.append(row(run, None))
                continue
            result = replay(
                self.trace, run.policy, run.gpu_slots, layout=run.layout, backend=self.backend,
                on_step=lambda _: tick(1),
            )  # fmt: skip
            rows.append(row(run, result))
        occupancy = []
        for label, layout in self.occupancy_runs:
            result = replay(self.trace, ExactLRU(), self.mid, layout=layout, on_step=lambda _: tick(1))
            occupancy.append(
                occupancy_row(
                    label, result.peak_distinct_entries, result.peak_physical_slots, result.hit_rate
                )
            )
        if self.striped_world > 1:
            from .spawn import run_ranks

            for attention in ("fetch", "local"):
                ranks = run_ranks(
                    striped_replay, self.striped_world, self.trace, self.mid, self.buckets, attention
                )
                distinct, physical = sum(r["distinct"] for r in ranks), sum(r["physical"] for r in ranks)
                # fetch: physical counts the buffers' copies too, and the hit rate is the buffer's
                # (the same on every rank)
                label = f"Striped {attention} (world {self.striped_world})"
                occupancy.append(occupancy_row(label, distinct, physical, ranks[0]["hit_rate"]))
        return rows, occupancy
