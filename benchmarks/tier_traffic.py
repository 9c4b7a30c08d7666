"""Bytes between the GPU and the CPU per decode step: ulakv's exclusive tier with clean evictions
against the CPU-offload baseline (a full CPU copy written eagerly, per-request GPU buffers), on one
DSA-shaped trace where every request gains a token every step.

    python benchmarks/tier_traffic.py                    # the table in RESULTS.md (about a minute)
    python benchmarks/tier_traffic.py --backend pool     # the same on real pools (kernels; slow)

At 1.5x, 2x and 4x one step's working set of GPU rows a group (the baseline gets the same rows,
split in equal per-request quotas). Out: rows written to the CPU (prefill and new tokens that land
there, evictions that copy); in: misses brought to the GPU. "no clean" is what ulakv's out would be
if every eviction copied its row, from the same run (its clean evictions priced at a row each).
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from ulakv import PBLRU, CPUOffloadBaseline, ExactLRU
from ulakv.replay import replay
from ulakv.traces import SyntheticSpec, Trace, synthetic

SPEC = SyntheticSpec(requests=16, prompt=(4096, 8192), steps=32, topk=2048, queries=1, groups=2, seed=3)
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


def rows(trace: Trace, backend: str) -> list[dict]:
    working = trace.working_set()
    alive, per_request = concurrency(trace)
    total = sum(r.prompt_len + r.steps for r in trace.requests)
    row_bytes = BYTES_PER_LAYER * LAYERS_PER_GROUP
    kw = dict(
        bytes_per_layer=BYTES_PER_LAYER, layers_per_group=LAYERS_PER_GROUP, backend=backend, belady=False
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
        out.append(dict(x=x, slots=slots, system="CPU offload", result=base, no_clean=None, base=base))
        for policy, name in ((ExactLRU(), "ulakv exact LRU"), (PBLRU(8), "ulakv PB-LRU(8)")):
            result = replay(trace, policy, slots, **kw)
            clean = result.pool_stats["clean_evictions"]
            no_clean = result.bytes_out_per_step + clean * row_bytes / result.steps
            out.append(dict(x=x, slots=slots, system=name, result=result, no_clean=no_clean, base=base))
    return out


def table(found: list[dict]) -> str:
    lines = [
        "| x ws | GPU rows | system | hit rate | MB in/step | MB out/step | out, no clean | in+out | "
        "out / baseline | in+out / baseline | clean evictions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in found:
        r, b = row["result"], row["base"]
        both, base_both = (
            r.bytes_in_per_step + r.bytes_out_per_step,
            b.bytes_in_per_step + b.bytes_out_per_step,
        )
        no_clean = f"{row['no_clean'] / 1e6:.3f}" if row["no_clean"] is not None else ""
        clean = r.pool_stats.get("clean_evictions")
        share = f"{clean:,} of {r.victims:,}" if clean is not None and row["no_clean"] is not None else ""
        lines.append(
            f"| {row['x']} | {row['slots']:,} | {row['system']} | {100 * r.hit_rate:.2f}% "
            f"| {r.bytes_in_per_step / 1e6:.3f} | {r.bytes_out_per_step / 1e6:.3f} | {no_clean} "
            f"| {both / 1e6:.3f} | {r.bytes_out_per_step / b.bytes_out_per_step:.2f} "
            f"| {both / base_both:.2f} | {share} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("model", "pool"), default="model")
    args = parser.parse_args()
    trace = synthetic(SPEC)
    print(
        f"trace: {SPEC.requests} requests, prompts {SPEC.prompt[0]}-{SPEC.prompt[1]}, {SPEC.steps} steps, "
        f"top-{SPEC.topk}, {SPEC.queries} query position(s), {SPEC.groups} groups, seed {SPEC.seed}; "
        f"one step's working set {trace.working_set():,} rows a group; {BYTES_PER_LAYER}-byte rows"
    )
    print(table(rows(trace, args.backend)))


if __name__ == "__main__":
    main()
