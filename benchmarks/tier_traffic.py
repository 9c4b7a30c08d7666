"""Bytes between the GPU and the CPU per decode step: ulakv's exclusive tier with clean evictions
and write copies against the CPU-offload baseline (a full CPU copy written eagerly, per-request GPU
buffers), on two DSA-shaped traces where every request gains a token every step.

    python benchmarks/tier_traffic.py                    # the tables in RESULTS.md (a few minutes)
    python benchmarks/tier_traffic.py --backend pool     # the same on real pools (kernels; slow)

At 1.5x, 2x and 4x one step's working set of GPU rows a group (the baseline gets the same rows,
split in equal per-request quotas). Out: rows written to the CPU (prompt and new tokens that land
there or take a copy, rewrites through to a copy, evictions that copy); in: misses brought to the
GPU. Per step: after the first ``WARMUP`` steps. Total: the whole run, prompts included. "before"
is ulakv with ``Tiered(write_copies=False)`` on the same trace: written rows get no copy, so each is
copied out at its first eviction (the behaviour before write copies). "one plan" is ulakv with each
step's new tokens written by every group's prepare (``prepare(..., new=NewRows(...))``) instead of
by a write before it.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from ulakv import PBLRU, CPUOffloadBaseline, ExactLRU, Tiered
from ulakv.replay import replay
from ulakv.traces import SyntheticSpec, Trace, synthetic

SPEC = SyntheticSpec(requests=16, prompt=(4096, 8192), steps=32, topk=2048, queries=1, groups=2, seed=3)
# Like the unseen trace of issue 32: 4 requests of 1.2-2.4 K tokens, top-64, 40 steps, all at once.
SMALL_SPEC = SyntheticSpec(
    requests=4, prompt=(1200, 2400), steps=40, topk=64, queries=1, groups=2, arrival_spread=0, seed=11
)
WARMUP = 8  # decode steps before the per-step figures count
CAPACITIES = (1.5, 2.0, 4.0)
BYTES_PER_LAYER = 656
LAYERS_PER_GROUP = 1


def concurrency(trace: Trace) -> tuple[int, int]:
    """Most requests decoding at once, and the most distinct positions one request selects in a
    group-step (what a per-request quota must hold)."""
    alive = max(
        sum(1 for r in trace.requests if r.arrival <= step < r.arrival + r.steps)
        for step in range(trace.horizon)
    )
    largest = max(
        int(r.topk[s, g][r.topk[s, g] >= 0].unique().numel())
        for r in trace.requests
        for s in range(r.steps)
        for g in range(trace.groups)
    )
    return alive, largest


def rows(trace: Trace, backend: str, buckets: int = 8) -> list[dict]:
    """Each capacity's baseline, then each policy with write copies and without (before)."""
    working = trace.working_set()
    alive, per_request = concurrency(trace)
    total = sum(r.prompt_len + r.steps for r in trace.requests)
    kw = dict(
        bytes_per_layer=BYTES_PER_LAYER,
        layers_per_group=LAYERS_PER_GROUP,
        backend=backend,
        belady=False,
        warmup=WARMUP,
    )
    out = []
    for x in CAPACITIES:
        slots = math.ceil(x * working)
        quota = slots // alive
        if quota < per_request:
            raise SystemExit(f"{x} x working set: a quota of {quota} cannot hold {per_request} picks")
        base = replay(
            trace,
            ExactLRU(),
            slots,
            layout=CPUOffloadBaseline(cpu_slots=total, slots_per_request=quota, max_requests=alive),
            **kw,
        )
        out.append(
            dict(x=x, slots=slots, system="CPU offload", result=base, before=None, base=base, fused=None)
        )
        for policy, name in ((ExactLRU(), "ulakv exact LRU"), (PBLRU(buckets), f"ulakv PB-LRU({buckets})")):
            result = replay(trace, policy, slots, **kw)
            old = Tiered(gpu_slots=slots, cpu_slots=total, policy=policy, write_copies=False)
            before = replay(trace, policy, slots, layout=old, **kw)
            fused = replay(trace, policy, slots, fused=True, **kw)
            out.append(
                dict(x=x, slots=slots, system=name, result=result, before=before, base=base, fused=fused)
            )
    return out


def _moved(r) -> tuple[float, float]:
    """Bytes in and out a step after the warm-up, and bytes in and out over the whole run."""
    per_step = r.warm_bytes_in_per_step + r.warm_bytes_out_per_step
    return per_step, r.pool_stats["bytes_in"] + r.pool_stats["bytes_out"]


def table(found: list[dict]) -> str:
    lines = [
        "| x ws | GPU rows | system | hit rate | MB in/step | MB out/step | in+out / baseline "
        "| before: MB out/step | before: in+out / baseline | total MB | total / baseline "
        "| before: total / baseline | one plan: MB out/step | one plan: in+out / baseline "
        "| one plan: total / baseline | clean evictions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in found:
        r, b, old, fused = row["result"], row["base"], row["before"], row["fused"]
        step, whole = _moved(r)
        base_step, base_whole = _moved(b)
        before_cells = ["", "", ""]
        if old is not None:
            old_step, old_whole = _moved(old)
            before_cells = [
                f"{old.warm_bytes_out_per_step / 1e6:.3f}",
                f"{old_step / base_step:.2f}",
                f"{old_whole / base_whole:.2f}",
            ]
        fused_cells = ["", "", ""]
        if fused is not None:
            fused_step, fused_whole = _moved(fused)
            fused_cells = [
                f"{fused.warm_bytes_out_per_step / 1e6:.3f}",
                f"{fused_step / base_step:.2f}",
                f"{fused_whole / base_whole:.2f}",
            ]
        clean = r.pool_stats.get("clean_evictions")
        share = f"{clean:,} of {r.victims:,}" if old is not None else ""
        lines.append(
            f"| {row['x']} | {row['slots']:,} | {row['system']} | {100 * r.hit_rate:.2f}% "
            f"| {r.warm_bytes_in_per_step / 1e6:.3f} | {r.warm_bytes_out_per_step / 1e6:.3f} "
            f"| {step / base_step:.2f} | {before_cells[0]} | {before_cells[1]} | {whole / 1e6:.1f} "
            f"| {whole / base_whole:.2f} | {before_cells[2]} | {fused_cells[0]} | {fused_cells[1]} "
            f"| {fused_cells[2]} | {share} |"
        )
    return "\n".join(lines)


def describe(spec: SyntheticSpec, trace: Trace) -> str:
    return (
        f"trace: {spec.requests} requests, prompts {spec.prompt[0]}-{spec.prompt[1]}, {spec.steps} steps, "
        f"top-{spec.topk}, {spec.queries} query position(s), {spec.groups} groups, arrivals over "
        f"{spec.arrival_spread} steps, seed {spec.seed}; one step's working set {trace.working_set():,} "
        f"rows a group; {BYTES_PER_LAYER}-byte rows; per-step figures after {WARMUP} steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("model", "pool"), default="model")
    parser.add_argument("--buckets", type=int, default=8, help="PB-LRU's buckets (recency in rounds)")
    parser.add_argument("--trace", choices=("A", "B", "both"), default="both")
    args = parser.parse_args()
    for name, spec in (("A", SPEC), ("B", SMALL_SPEC)):
        if args.trace not in (name, "both"):
            continue
        trace = synthetic(spec)
        print(describe(spec, trace))
        print(table(rows(trace, args.backend, args.buckets)), flush=True)


if __name__ == "__main__":
    main()
