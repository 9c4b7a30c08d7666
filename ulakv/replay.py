"""Replay a selection trace through a real pool and measure what a policy costs.

Every request is admitted when it arrives, prefilled (all its tokens written in every layer), then
decoded: each step it gains a token, the token's rows are written, and every layer group prepares
that step's selection. Reported: hits, misses, hit rate, bytes moved per step, victim-search reads,
and the Belady (OPT) hit rate of the same rounds at the same GPU capacity, the ceiling for any
policy that must hold a round's whole selection at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .config import PBLRU, EntrySpec, ExactLRU, PoolConfig, Tiered
from .pool import Pool
from .traces import Trace


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    gpu_slots: int
    steps: int
    prepares: int
    hits: int
    misses: int
    hit_rate: float
    belady_hit_rate: float
    bytes_in_per_step: float
    bytes_out_per_step: float
    victims: int
    victim_search_reads: int
    round_upkeep_reads: int

    def as_dict(self) -> dict:
        return asdict(self)


def policy_name(policy: ExactLRU | PBLRU) -> str:
    return "exact_lru" if isinstance(policy, ExactLRU) else f"pblru({policy.num_buckets})"


def belady_hits(events: list[tuple[str, list[int]]], capacity: int) -> tuple[int, int]:
    """Hits and misses of Belady's OPT over a group's events, the ceiling for any policy.

    ``("select", addrs)`` is a round of distinct addresses: every one must be resident during it
    (a miss loads it, evicting the resident address used again furthest ahead, never one of this
    round's). ``("write", addrs)`` creates entries that may be cached for free: OPT keeps one only if
    it is used again sooner than something it would evict (bypass otherwise). Lazy max-heap on next
    use: O(accesses log accesses).
    """
    never = len(events)
    next_use: list[dict[int, int]] = [{} for _ in events]
    upcoming: dict[int, int] = {}
    for i in range(len(events) - 1, -1, -1):
        kind, addrs = events[i]
        for a in addrs:
            next_use[i][a] = upcoming.get(a, never)
        if kind == "select":
            for a in addrs:
                upcoming[a] = i
    resident: dict[int, int] = {}  # address -> its next use as pushed
    heap: list[tuple[int, int]] = []

    def farthest(protect: set[int]) -> tuple[int, int] | None:
        kept, found = [], None
        while heap:
            neg, a = heapq.heappop(heap)
            if resident.get(a) != -neg:
                continue  # stale
            if a in protect:
                kept.append((neg, a))
                continue
            found = (neg, a)
            break
        for item in kept:
            heapq.heappush(heap, item)
        return found

    hits = misses = 0
    for i, (kind, addrs) in enumerate(events):
        if kind == "write":
            for a in addrs:
                nu = next_use[i][a]
                if nu == never:
                    continue
                if len(resident) >= capacity:
                    top = farthest(set())
                    if top is None or -top[0] <= nu:
                        if top is not None:
                            heapq.heappush(heap, top)
                        continue
                    del resident[top[1]]
                resident[a] = nu
                heapq.heappush(heap, (-nu, a))
            continue
        now = set(addrs)
        missing = [a for a in addrs if a not in resident]
        hits += len(addrs) - len(missing)
        misses += len(missing)
        for a in addrs:  # this round's addresses are protected: their next use moves past i
            resident[a] = next_use[i][a]
            heapq.heappush(heap, (-resident[a], a))
        while len(resident) > capacity:
            _, a = farthest(now)
            del resident[a]
    return hits, misses


def replay(
    trace: Trace,
    policy: ExactLRU | PBLRU,
    gpu_slots: int,
    *,
    bytes_per_layer: int = 656,
    layers_per_group: int = 1,
    device: str = "cpu",
    on_step: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Run ``trace`` through a tiered pool whose CPU tier holds everything (capacity never binds),
    with ``gpu_slots`` GPU slots per group and ``policy``."""
    groups = trace.groups
    total_tokens = sum(r.prompt_len + r.steps for r in trace.requests)
    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=bytes_per_layer),
        num_layers=groups * layers_per_group,
        layers_per_group=layers_per_group,
        layout=Tiered(gpu_slots=gpu_slots, cpu_slots=total_tokens, policy=policy),
        device=device,
        validate=False,
    )
    pool = Pool(cfg)
    seqs: dict[int, object] = {}
    events: list[list[tuple[str, list[int]]]] = [[] for _ in range(groups)]
    zeros = torch.zeros(
        (max(r.prompt_len for r in trace.requests), bytes_per_layer), dtype=torch.uint8, device=device
    )
    prepares = 0
    for step in range(trace.horizon):
        active = []
        for i, r in enumerate(trace.requests):
            s = step - r.arrival
            if s == 0:
                seq = seqs[i] = pool.admit(r.prompt_len)
                for layer in range(cfg.num_layers):
                    pool.write(layer, seq.addresses, zeros[: r.prompt_len])
                for g in range(groups):
                    events[g].append(("write", list(seq._addresses)))
            if 0 <= s < r.steps:
                active.append((i, s))
        if not active:
            continue
        new = torch.cat([pool.extend(seqs[i], 1) for i, _ in active])
        for layer in range(cfg.num_layers):
            pool.write(layer, new, zeros[: new.numel()])
        for g in range(groups):
            events[g].append(("write", new.tolist()))
        for g in range(groups):
            picks = []
            for i, s in active:
                pos = trace.requests[i].topk[s, g].to(torch.int64)
                addrs = seqs[i].addresses
                picks.append(torch.where(pos >= 0, addrs[pos.clamp(min=0)], -1))
            sel = torch.stack(picks)
            pool.prepare(g, sel)
            prepares += 1
            per_request = [list(dict.fromkeys(a for a in row if a >= 0)) for row in sel.flatten(1).tolist()]
            events[g].append(("select", [a for row in per_request for a in row]))
        for i, s in active:
            if s == trace.requests[i].steps - 1:
                pool.release(seqs.pop(i))
        if on_step is not None:
            on_step(step)
    stats = pool.stats()
    best_hits = best_misses = 0
    for g in range(groups):
        h, m = belady_hits(events[g], gpu_slots)
        best_hits += h
        best_misses += m
    accesses = stats["hits"] + stats["misses"]
    steps = trace.horizon
    return ReplayResult(
        policy=policy_name(policy),
        gpu_slots=gpu_slots,
        steps=steps,
        prepares=prepares,
        hits=stats["hits"],
        misses=stats["misses"],
        hit_rate=stats["hits"] / accesses if accesses else 0.0,
        belady_hit_rate=best_hits / (best_hits + best_misses) if accesses else 0.0,
        bytes_in_per_step=stats["bytes_in"] / steps,
        bytes_out_per_step=stats["bytes_out"] / steps,
        victims=stats["victims"],
        victim_search_reads=stats["victim_search_reads"],
        round_upkeep_reads=stats["round_upkeep_reads"],
    )
