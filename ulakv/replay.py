"""Replay a selection trace through a real pool and measure what a policy costs.

Every request is admitted when it arrives, prefilled (all its tokens written in every layer), then
decoded: each step it gains a token, the token's rows are written, and every layer group prepares
that step's selection. Reported: hits, misses, hit rate, bytes moved per step, victim-search reads,
the Belady (OPT) hit rate of the same rounds at the same GPU capacity, the ceiling for any
policy that must hold a round's whole selection at once, and distinct entries / physical slots at
the step the pool held most (1.0 for an exclusive layout; 1/world replicated; below 1 with copies).

Any layout replays through a real pool; ``Tiered`` and ``CPUOffloadBaseline`` also through plain
models of their policies (``backend="model"``), which decide exactly what the kernels decide.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .config import PBLRU, CPUOffloadBaseline, EntrySpec, ExactLRU, LayoutConfig, PoolConfig, Tiered
from .errors import CapacityError
from .frame import NewRows
from .policies import ExactLRUModel, PBLRUModel
from .policies.cpu_tier import CPUTierModel
from .policies.protocol import distinct
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
    pool_stats: dict = field(default_factory=dict, compare=False)  # the target's final counters
    system: str = "ulakv"  # ulakv (tiered), cpu_offload, replicated, striped
    peak_distinct_entries: int = 0  # at the step with the most physical slots in use
    peak_physical_slots: int = 0
    # Bytes per step over the steps from ``warmup`` on (``replay(warmup=...)``; all steps when 0)
    warm_bytes_in_per_step: float = 0.0
    warm_bytes_out_per_step: float = 0.0

    @property
    def distinct_per_slot(self) -> float:
        return self.peak_distinct_entries / self.peak_physical_slots if self.peak_physical_slots else 0.0

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


class _PoolTarget:
    """Replay target: a real tiered pool (its kernels decide)."""

    def __init__(self, cfg: PoolConfig) -> None:
        self.pool = Pool(cfg)
        self.cfg = cfg
        self.seqs: dict[int, object] = {}
        self.zeros = torch.zeros((1, cfg.entry.bytes_per_layer), dtype=torch.uint8, device=cfg.torch_device)

    def _write(self, addresses: torch.Tensor) -> None:
        rows = self.zeros.expand(addresses.numel(), -1)
        for layer in range(self.cfg.num_layers):
            self.pool.write(layer, addresses, rows)

    def admit(self, key: int, n: int) -> list[int]:
        seq = self.seqs[key] = self.pool.admit(n)
        self._write(seq.addresses)
        return list(seq.address_list)

    def extend(self, keys: list[int], write: bool = True) -> list[int]:
        new = torch.cat([self.pool.extend(self.seqs[k], 1) for k in keys])
        if write:
            self._write(new)
        return new.tolist()

    def prepare(
        self, group: int, rows: list[list[int]], keys: list[int], new: list[int] | None = None
    ) -> None:
        device = self.cfg.torch_device
        kwargs = {}
        if new is not None:  # the step's new tokens, written in the prepare's plan (one-layer groups)
            addresses = torch.tensor(new, dtype=torch.int64, device=device)
            rows_new = self.zeros.expand(len(new), -1)
            kwargs["new"] = NewRows(self.cfg.group_layers(group).start, addresses, rows_new)
        self.pool.prepare(group, torch.tensor(rows, dtype=torch.int64, device=device), **kwargs)

    def release(self, key: int) -> None:
        self.pool.release(self.seqs.pop(key))

    def counters(self) -> dict[str, int]:
        return self.pool.stats()

    def occupancy(self) -> tuple[int, int]:
        stats = self.pool.stats()
        return stats["distinct_entries"], stats["physical_slots_used"]


class _AddressBook:
    """A model target's addresses: handed out in order, never reused (a replay's pool is large
    enough that reuse would change nothing the models decide)."""

    def __init__(self) -> None:
        self.addresses: dict[int, list[int]] = {}
        self.next_address = 0

    def _admit(self, key: int, n: int) -> list[int]:
        self.addresses[key] = list(range(self.next_address, self.next_address + n))
        self.next_address += n
        return list(self.addresses[key])

    def _extend(self, keys: list[int]) -> list[int]:
        new = list(range(self.next_address, self.next_address + len(keys)))
        for k, a in zip(keys, new, strict=True):
            self.addresses[k].append(a)
        self.next_address += len(keys)
        return new


class _ModelTarget(_AddressBook):
    """Replay target: the policies' plain models, one per group, with the pool's byte accounting.
    Decides exactly what the kernels decide (tests hold the two replays equal), far faster."""

    def __init__(self, cfg: PoolConfig) -> None:
        super().__init__()
        slots, policy = cfg.layout.gpu_slots, cfg.layout.policy
        make = (
            (lambda: ExactLRUModel(slots, protocol=False))
            if isinstance(policy, ExactLRU)
            else (lambda: PBLRUModel(slots, policy.num_buckets, protocol=False))
        )
        self.cfg = cfg
        self.models = [make() for _ in range(cfg.num_groups)]
        self.cpu_rows = cfg.layout.cpu_slots + cfg.layout.cpu_staging
        self.write_copies = cfg.layout.write_copies
        self.tiers = [CPUTierModel(self.cpu_rows, self.write_copies) for _ in range(cfg.num_groups)]
        self.stats = dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out", "victims"), 0)
        self.stats.update(victim_search_reads=-1, round_upkeep_reads=-1)  # models do not count words
        self.clean_before_reset = 0

    def _write(self, addresses: list[int]) -> None:
        width = self.cfg.entry.bytes_per_layer
        for group, (model, tier) in enumerate(zip(self.models, self.tiers, strict=True)):
            layers = self.cfg.group_layers(group)
            new = set(addresses)
            for _ in layers:
                homed_on_gpu = [a for a in distinct(addresses) if a not in new and model.resident(a)]
                placed, victims = model.write(addresses, new)
                fresh = [a for a in distinct(addresses) if a in new]
                copied, made, through = tier.write(
                    victims, fresh[len(placed) :], fresh[: len(placed)], homed_on_gpu
                )
                new = set()
                self.stats["victims"] += len(victims)
                on_cpu = sum(1 for a in addresses if not model.resident(a))
                # victims' and new copies' rows, every layer; rows written on the CPU or through
                moved = (copied + made) * len(layers) + on_cpu + through
                self.stats["bytes_out"] += moved * width

    def admit(self, key: int, n: int) -> list[int]:
        addrs = self._admit(key, n)
        self._write(addrs)
        return addrs

    def extend(self, keys: list[int], write: bool = True) -> list[int]:
        new = self._extend(keys)
        if write:
            self._write(new)
        return new

    def prepare(
        self, group: int, rows: list[list[int]], keys: list[int], new: list[int] | None = None
    ) -> None:
        """A prepare; with ``new``, the step's new tokens planned with it (they lead its elements,
        are its first misses, and are written, not missed)."""
        fresh = list(new or [])
        hits, misses, victims = self.models[group].prepare(fresh + [a for row in rows for a in row])
        row_bytes = len(self.cfg.group_layers(group)) * self.cfg.entry.bytes_per_layer
        made = 0
        if fresh:
            copied, made = self.tiers[group].prepare_new(victims, misses, len(fresh))
        else:
            copied = self.tiers[group].prepare(victims, misses)
        self.stats["hits"] += len(hits)
        self.stats["misses"] += len(misses) - len(fresh)
        self.stats["bytes_in"] += (len(misses) - len(fresh)) * row_bytes
        self.stats["bytes_out"] += (copied + made) * row_bytes
        self.stats["victims"] += len(victims)

    def release(self, key: int) -> None:
        for model, tier in zip(self.models, self.tiers, strict=True):
            model.release(self.addresses[key])
            tier.release(self.addresses[key])
        del self.addresses[key]
        if not self.addresses:  # the pool resets its residency when no request is left
            self.clean_before_reset += sum(t.clean_evictions for t in self.tiers)
            for model in self.models:
                model.reset()
            self.tiers = [CPUTierModel(self.cpu_rows, self.write_copies) for _ in self.models]

    def counters(self) -> dict[str, int]:
        clean = self.clean_before_reset + sum(t.clean_evictions for t in self.tiers)
        return dict(self.stats, clean_evictions=clean)

    def occupancy(self) -> tuple[int, int]:
        homed = self.cfg.num_groups * sum(len(a) for a in self.addresses.values())
        return homed, homed  # exclusive: one home each


class _OffloadModelTarget(_AddressBook):
    """Replay target: the CPU-offload baseline as plain models, one exact LRU of
    ``slots_per_request`` entries per request and group; every write is backed up to the CPU."""

    def __init__(self, cfg: PoolConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quota = cfg.layout.slots_per_request
        self.models: dict[int, list[ExactLRUModel]] = {}
        self.stats = dict.fromkeys(("hits", "misses", "bytes_in", "bytes_out", "victims"), 0)
        self.stats.update(victim_search_reads=-1, round_upkeep_reads=-1)

    def _write(self, key: int, addresses: list[int]) -> None:
        """Backed up to the CPU at once; the last ``quota`` enter the request's buffers, one
        round of each group's LRU that counts only its victims."""
        self.stats["bytes_out"] += len(addresses) * self.cfg.num_layers * self.cfg.entry.bytes_per_layer
        for model in self.models[key]:
            self.stats["victims"] += len(model.prepare(addresses[-self.quota :])[2])

    def admit(self, key: int, n: int) -> list[int]:
        if len(self.models) == self.cfg.layout.max_requests:
            raise CapacityError("all per-request GPU buffers are in use")
        self.models[key] = [ExactLRUModel(self.quota, protocol=False) for _ in range(self.cfg.num_groups)]
        addresses = self._admit(key, n)
        self._write(key, addresses)
        return addresses

    def extend(self, keys: list[int]) -> list[int]:
        new = self._extend(keys)
        for key, a in zip(keys, new, strict=True):
            self._write(key, [a])
        return new

    def prepare(self, group: int, rows: list[list[int]], keys: list[int]) -> None:
        row_bytes = len(self.cfg.group_layers(group)) * self.cfg.entry.bytes_per_layer
        for key, row in zip(keys, rows, strict=True):
            if len(distinct(row)) > self.quota:
                raise CapacityError(f"a request selects more than its quota of {self.quota}")
            hits, misses, victims = self.models[key][group].prepare(row)
            self.stats["hits"] += len(hits)
            self.stats["misses"] += len(misses)
            self.stats["bytes_in"] += len(misses) * row_bytes
            self.stats["victims"] += len(victims)

    def release(self, key: int) -> None:
        del self.models[key], self.addresses[key]

    def counters(self) -> dict[str, int]:
        return dict(self.stats)

    def occupancy(self) -> tuple[int, int]:
        history = self.cfg.num_groups * sum(len(a) for a in self.addresses.values())
        copies = sum(len(m.order) for models in self.models.values() for m in models)
        return history, history + copies


def _target(cfg: PoolConfig, backend: str):
    if backend == "pool":
        return _PoolTarget(cfg)
    if isinstance(cfg.layout, CPUOffloadBaseline):
        return _OffloadModelTarget(cfg)
    if isinstance(cfg.layout, Tiered):
        return _ModelTarget(cfg)
    raise ValueError("the model backend replays Tiered and CPUOffloadBaseline layouts; use backend='pool'")


def system_name(layout: LayoutConfig | None) -> str:
    from .config import Replicated, Striped

    if isinstance(layout, CPUOffloadBaseline):
        return "cpu_offload"
    if isinstance(layout, Replicated):
        return "replicated"
    if isinstance(layout, Striped):
        return "striped"
    return "ulakv"


def replay(
    trace: Trace,
    policy: ExactLRU | PBLRU,
    gpu_slots: int,
    *,
    bytes_per_layer: int = 656,
    layers_per_group: int = 1,
    device: str = "cpu",
    backend: str = "pool",
    on_step: Callable[[int], None] | None = None,
    layout: LayoutConfig | None = None,
    belady: bool = True,
    warmup: int = 0,
    fused: bool = False,
) -> ReplayResult:
    """Run ``trace`` with ``gpu_slots`` GPU slots per group and ``policy``; the CPU tier holds
    everything, so capacity never binds. ``backend="pool"`` runs a real pool (its kernels);
    ``"model"`` runs the policies' plain models, which decide the same (word counts excepted).
    ``layout`` replaces the tiered layout: a ``Striped`` rank, for instance, whose buffer of
    ``gpu_slots`` is what the hits, misses and Belady figures describe, or a baseline;
    ``ReplayResult.pool_stats`` keeps the pool's own counters. ``belady=False`` skips the Belady
    bound (its hit rate is then NaN): byte studies of long traces do not need it. ``warmup``: the
    ``warm_*`` figures count only the steps from this one on (a request admitted then still has
    its prompt counted). ``fused``: each step's new tokens are written by every group's prepare
    (``new=``, one plan), not by a write before them (one-layer groups, tiered pools only)."""
    groups = trace.groups
    total_tokens = sum(r.prompt_len + r.steps for r in trace.requests)
    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=bytes_per_layer),
        num_layers=groups * layers_per_group,
        layers_per_group=layers_per_group,
        layout=layout or Tiered(gpu_slots=gpu_slots, cpu_slots=total_tokens, policy=policy),
        device=device,
        validate=False,
    )
    if backend not in ("pool", "model"):
        raise ValueError(f"backend must be 'pool' or 'model', got {backend!r}")
    if fused and (layers_per_group != 1 or not isinstance(cfg.layout, Tiered)):
        raise ValueError("fused replays take one-layer groups of a tiered pool")
    target = _target(cfg, backend)
    peak = (0, 0)
    addresses: dict[int, list[int]] = {}
    events: list[list[tuple[str, list[int]]]] = [[] for _ in range(groups)]
    prepares = 0
    warm = dict.fromkeys(("bytes_in", "bytes_out"), 0)
    for step in range(trace.horizon):
        if step == warmup:
            warm = target.counters()
        active = []
        for i, r in enumerate(trace.requests):
            s = step - r.arrival
            if s == 0:
                addresses[i] = target.admit(i, r.prompt_len)
                for g in range(groups):
                    events[g].append(("write", list(addresses[i])))
            if 0 <= s < r.steps:
                active.append((i, s))
        if not active:
            continue
        keys = [i for i, _ in active]
        new = target.extend(keys, write=False) if fused else target.extend(keys)
        for (i, _), a in zip(active, new, strict=True):
            addresses[i].append(a)
        for g in range(groups):
            events[g].append(("write", new))
        for g in range(groups):
            rows = []
            for i, s in active:
                own = addresses[i]
                rows.append(
                    [own[p] if p >= 0 else -1 for p in trace.requests[i].topk[s, g].flatten().tolist()]
                )
            target.prepare(g, rows, [i for i, _ in active], *([new] if fused else []))
            prepares += 1
            events[g].append(("select", [a for row in rows for a in distinct(row)]))
        held = target.occupancy()
        if held[1] > peak[1]:
            peak = held
        for i, s in active:
            if s == trace.requests[i].steps - 1:
                target.release(i)
                del addresses[i]
        if on_step is not None:
            on_step(step)
    stats = target.counters()
    best_hits = best_misses = 0
    for g in range(groups if belady else 0):
        h, m = belady_hits(events[g], gpu_slots)
        best_hits += h
        best_misses += m
    accesses = stats["hits"] + stats["misses"]
    steps = trace.horizon
    counted = max(steps - warmup, 1)
    return ReplayResult(
        policy=policy_name(policy),
        gpu_slots=gpu_slots,
        steps=steps,
        prepares=prepares,
        hits=stats["hits"],
        misses=stats["misses"],
        hit_rate=stats["hits"] / accesses if accesses else 0.0,
        belady_hit_rate=best_hits / (best_hits + best_misses) if accesses and belady else float("nan"),
        bytes_in_per_step=stats["bytes_in"] / steps,
        bytes_out_per_step=stats["bytes_out"] / steps,
        victims=stats["victims"],
        victim_search_reads=stats["victim_search_reads"],
        round_upkeep_reads=stats["round_upkeep_reads"],
        pool_stats=dict(stats),
        system=system_name(layout),
        peak_distinct_entries=peak[0],
        peak_physical_slots=peak[1],
        warm_bytes_in_per_step=(stats["bytes_in"] - warm["bytes_in"]) / counted,
        warm_bytes_out_per_step=(stats["bytes_out"] - warm["bytes_out"]) / counted,
    )
