"""Policy suite: hit rates of exact LRU and PB-LRU against Belady on synthetic DSA-shaped traces,
and the words a victim search reads as the pool grows. Prints Markdown for benchmarks/RESULTS.md.

    python benchmarks/policy_suite.py [--suite large|small|quick] [--backend model|pool]

``--backend pool`` replays through the real pool (its Triton kernels; interpreted on a CPU machine);
``--backend model`` through the policies' plain models, which tests hold equal to the pool down to
the bytes moved (tests/test_traces.py), and which make the large suite affordable on a CPU.
Victim-search reads come from the serial bitmap search the pool ran before its candidate lists
(``serial_search.py``, kept for that table).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from datetime import date

if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from serial_search import bucket_bits, search

from ulakv import PBLRU, ExactLRU
from ulakv.kernels.buckets import level_offsets
from ulakv.replay import replay
from ulakv.traces import SyntheticSpec, synthetic

SUITES = {
    # ~150 K distinct accesses a trace: a 0.1 pp hit-rate difference is ~150 accesses.
    "large": {
        "dsa-spec3": SyntheticSpec(requests=12, steps=48, seed=11),
        "dsa-nospec": SyntheticSpec(requests=12, steps=48, queries=1, seed=12),
        "low-reuse": SyntheticSpec(requests=12, steps=48, far_reuse=0.3, drift=0.15, seed=13),
    },
    # ~45 K accesses a trace: small enough for the interpreted pool.
    "small": {
        "dsa-spec3": SyntheticSpec(requests=6, steps=24, seed=1),
        "dsa-nospec": SyntheticSpec(requests=6, steps=24, queries=1, seed=2),
        "low-reuse": SyntheticSpec(requests=6, steps=24, far_reuse=0.3, drift=0.15, seed=3),
    },
    "quick": {
        "dsa-spec3": SyntheticSpec(
            requests=3, steps=8, topk=64, heavy=24, window=16, prompt=(256, 512), seed=1
        )
    },
}
FACTORS = (1.5, 2.0, 4.0)


def hit_rate_table(suite: dict[str, SyntheticSpec], backend: str) -> list[str]:
    rows = [
        "| trace | GPU slots (x working set) | exact LRU | PB-LRU(8) | PB-LRU - LRU (pp) | Belady | "
        "MB in/step LRU | MB in/step PB-LRU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for name, spec in suite.items():
        trace = synthetic(spec)
        ws = trace.working_set()
        for factor in FACTORS:
            slots = int(ws * factor)
            lru = replay(trace, ExactLRU(), slots, backend=backend)
            pb = replay(trace, PBLRU(8), slots, backend=backend)
            assert lru.belady_hit_rate == pb.belady_hit_rate
            gap = 100 * (pb.hit_rate - lru.hit_rate)
            worst = max(worst, abs(gap))
            cells = [
                name,
                f"{slots} ({factor}x of {ws})",
                f"{lru.hit_rate:.2%}",
                f"{pb.hit_rate:.2%}",
                f"{gap:+.3f}",
                f"{lru.belady_hit_rate:.2%}",
                f"{lru.bytes_in_per_step / 1e6:.3f}",
                f"{pb.bytes_in_per_step / 1e6:.3f}",
            ]
            rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    rows.append(f"Largest |PB-LRU - exact LRU| gap: {worst:.3f} percentage points.")
    return rows


def search_table(victims: int = 64) -> list[str]:
    rows = [
        f"| GPU slots | summary levels | occupancy | words read for {victims} victims "
        "| a timestamp-scan exact LRU reads |",
        "|---|---|---|---|---|",
    ]
    for slots in (16 * 1024, 256 * 1024, 4 * 1024 * 1024):
        levels = len(level_offsets(slots)) - 1
        for name, occupied in (
            ("every slot", torch.ones(slots, dtype=torch.bool)),
            ("1% of slots", torch.rand(slots, generator=torch.Generator().manual_seed(0)) < 0.01),
        ):
            got, reads = search(bucket_bits(occupied), slots, victims)
            assert torch.equal(got.long(), torch.nonzero(occupied).flatten()[:victims])
            rows.append(f"| {slots:,} | {levels} | {name} | {reads} | {slots:,} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="large")
    parser.add_argument("--backend", choices=["model", "pool"], default="model")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or 'x86_64'}), Triton interpreter"
    )
    start = time.perf_counter()
    lines = [
        f"Date {date.today()}, commit {commit}, {device}, command "
        f"`python benchmarks/policy_suite.py --suite {args.suite} --backend {args.backend}`.",
        "",
        *hit_rate_table(SUITES[args.suite], args.backend),
        "",
        *search_table(),
        "",
        f"({time.perf_counter() - start:.0f} s)",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
