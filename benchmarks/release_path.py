"""A long request leaving: the critical path of its release, in memory operations of the busiest
programs (``tools.critical_path``), by number of layer groups and tokens, both policies.

    python benchmarks/release_path.py                        # 8 and 61 groups, 4K and 16K tokens
    python benchmarks/release_path.py --groups 61 --tokens 32768

A request leaves between two decode steps, on the stream the next step runs on, so its release
delays that step by its critical path. 61 one-layer groups is DeepSeek-V3.2 and GLM-5 under SGLang
(an indexer per layer). Two pools: one that hands out its addresses (``release(seq)``: 1 launch)
and an engine-owned one (``admit_addresses`` of the whole prompt, then ``release_addresses``: the
check, then the release kernel). Half a GPU tier of the request is written in every group, so both
tiers are freed. Runs under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/

import torch

from tools.critical_path import count_memory_ops, critical_path
from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered

GPU_SLOTS = 1024
WIDTH = 16  # bytes a row: the counts do not depend on it


def _pool(groups: int, tokens: int, policy, engine: bool) -> Pool:
    layout = Tiered(gpu_slots=GPU_SLOTS, cpu_slots=tokens, policy=policy)
    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=WIDTH),
        num_layers=groups,
        layers_per_group=1,
        layout=layout,
        validate=False,
        engine_addresses=GPU_SLOTS + tokens if engine else None,
    )
    return Pool(cfg)


def _written(pool: Pool, addrs: torch.Tensor) -> None:
    """Rows for the first GPU_SLOTS + GPU_SLOTS / 2 addresses in every group: the GPU full, some on
    the CPU."""
    some = addrs[: GPU_SLOTS + GPU_SLOTS // 2]
    rows = torch.zeros((some.numel(), WIDTH), dtype=torch.uint8)
    for layer in range(pool.config.num_layers):
        pool.write(layer, some, rows)


def measure(groups: int, tokens: int, policy) -> dict[str, tuple[list[tuple[str, int, int]], int]]:
    """``{call: ([(kernel, programs, busiest)], critical path)}`` for the three calls."""
    out = {}
    pool = _pool(groups, tokens, policy, engine=False)
    seq = pool.admit(tokens)
    _written(pool, seq.addresses)
    with count_memory_ops() as launches:
        pool.release(seq)
    out["release(seq)"] = launches
    pool = _pool(groups, tokens, policy, engine=True)
    locs = torch.randperm(GPU_SLOTS + tokens, generator=torch.Generator().manual_seed(0))[:tokens]
    with count_memory_ops() as launches:
        pool.admit_addresses(locs)
    out["admit_addresses"] = launches
    _written(pool, locs)
    with count_memory_ops() as launches:
        pool.release_addresses(locs)
    out["release_addresses"] = launches
    pool.check()
    return {
        call: (
            [(launch.kernel, launch.programs, launch.busiest) for launch in launches],
            critical_path(launches),
        )
        for call, launches in out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 61])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    print("| policy | groups | tokens | call | launches: kernel (programs, busiest) | critical path |")
    print("|---|--:|--:|---|---|--:|")
    for policy_name, policy in (("exact LRU", ExactLRU()), ("PB-LRU(8)", PBLRU(8))):
        for groups in args.groups:
            for tokens in args.tokens:
                start = time.perf_counter()
                for call, (launches, path) in measure(groups, tokens, policy).items():
                    shown = ", ".join(f"{k} ({p}, {b})" for k, p, b in launches)
                    print(f"| {policy_name} | {groups} | {tokens:,} | {call} | {shown} | **{path:,}** |")
                print(f"<!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
