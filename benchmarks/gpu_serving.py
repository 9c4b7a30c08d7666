"""The GPU suite's serving sections (``benchmarks/gpu_suite.py`` runs them): a long decode soak and
a whole decode step captured in one CUDA graph.

Both drive the pool as an engine does, through ``SparseKV``: each step writes every request's new
token and prepares a DSA-shaped selection (attention sinks, a local window, far positions that
drift: ``DecodeTrace``), with one-layer groups as SGLang runs DeepSeek-V3.2 and GLM-5.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ulakv import PBLRU, EntrySpec, ExactLRU, NewRows, Pool, PoolConfig, Tiered
from ulakv.engine import SparseKV
from ulakv.kernels._triton import count_launches

ROW = 656  # GLM-5 / DeepSeek-V3.2 MLA row: 512 + 64 fp8 latent, scales (bytes)


@dataclass(frozen=True)
class ServingSizes:
    soak_slots: int  # GPU slots of the soak's group
    soak_batches: tuple[int, ...]
    soak_steps: int
    soak_context: int  # tokens of history each request starts with
    soak_profiled: int  # steps the per-kernel table is taken over
    step_groups: int  # one-layer groups of the captured step
    step_slots: int
    step_batch: int
    topk: int


FULL = ServingSizes(1 << 20, (64, 256), 10_000, 4096, 50, 61, 1 << 16, 64, 2048)
SMOKE = ServingSizes(2048, (2,), 4, 64, 1, 2, 256, 2, 16)


class DecodeTrace:
    """Selections of ``batch`` requests, on the device: 64 sinks, a window of the last ``k / 4``
    tokens, and far positions (the rest of ``k``) of which a tenth move each step."""

    def __init__(self, batch: int, k: int, lengths: torch.Tensor, seed: int) -> None:
        self.k, self.lengths = k, lengths
        self.sinks, self.window = min(64, k // 4), k // 4
        self.far = k - self.sinks - self.window
        self.gen = torch.Generator(device=lengths.device).manual_seed(seed)
        self.hot = self._far_positions(batch, self.far)

    def _far_positions(self, batch: int, n: int) -> torch.Tensor:
        span = (self.lengths - self.window).clamp(min=1)[:, None]
        draw = torch.rand((batch, n), generator=self.gen, device=self.lengths.device)
        return (draw * span).long()

    def step(self) -> torch.Tensor:
        """Positions ``[batch, k]`` for the current lengths (then the caller grows them)."""
        batch = self.lengths.numel()
        move = torch.rand((batch, self.far), generator=self.gen, device=self.lengths.device) < 0.1
        self.hot = torch.where(move, self._far_positions(batch, self.far), self.hot)
        sinks = torch.arange(self.sinks, device=self.lengths.device).expand(batch, -1)
        window = self.lengths[:, None] - 1 - torch.arange(self.window, device=self.lengths.device)
        return torch.cat([sinks, window.clamp(min=0), self.hot], dim=1)


def _pool(device, groups: int, gpu: int, cpu: int, policy) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=ROW),
            num_layers=groups,
            layers_per_group=1,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=policy),
            device=device,
            validate=False,
        )
    )


class _Requests:
    """``batch`` requests admitted at their final length (every address live from the start,
    written as decode reaches it): ``table[r, t]`` is request ``r``'s token ``t``."""

    def __init__(self, pool: Pool, batch: int, context: int, steps: int) -> None:
        device = pool.device
        seqs = [pool.admit(context + steps + 1) for _ in range(batch)]
        self.table = torch.stack([s.addresses.to(device=device, dtype=torch.int64) for s in seqs])
        self.lengths = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.rows = torch.zeros((batch, ROW), dtype=torch.uint8, device=device)
        rows = torch.zeros((context, ROW), dtype=torch.uint8, device=device)
        for g in range(pool.num_groups):  # the prompts, chunk by chunk as a prefill writes them
            for r in range(batch):
                pool.write(g, self.table[r, :context], rows)

    def new_tokens(self) -> torch.Tensor:
        return self.table.gather(1, self.lengths[:, None]).flatten()

    def addresses(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table.gather(1, positions)


def soak(device: torch.device, sizes: ServingSizes) -> list[dict]:
    """``soak_steps`` decode steps of one group at each batch, both policies: every step writes
    the batch's new tokens and prepares its top-k; the step's time on the GPU (events around
    its calls, not waiting in between), median, p99 and worst; hits and evictions a step; then the
    kernels' time per launch over ``soak_profiled`` steps (the profiler)."""
    policies = (ExactLRU(), PBLRU(8))
    return [_soak(device, sizes, batch, policy) for batch in sizes.soak_batches for policy in policies]


def _soak(device: torch.device, sizes: ServingSizes, batch: int, policy) -> dict:
    steps, context = sizes.soak_steps, sizes.soak_context
    total = batch * (context + steps + 1)
    pool = _pool(device, 1, sizes.soak_slots, max(total - sizes.soak_slots, 0) + batch, policy)
    reqs = _Requests(pool, batch, context, steps)
    kv = SparseKV(pool, max_batch=batch, top_k=sizes.topk)
    trace = DecodeTrace(batch, sizes.topk, reqs.lengths, seed=batch)

    def step() -> None:
        kv.write(0, reqs.new_tokens(), reqs.rows)
        reqs.lengths += 1
        kv.prepare(0, reqs.addresses(trace.step()))
        kv.join()

    step()  # warm: compiled, scratch sized
    counted = steps - 1 - sizes.soak_profiled
    before = pool.stats()
    times, wall = _timed_steps(step, counted, device)
    after = pool.stats()
    seen = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    row = {
        "batch": batch,
        "policy": str(policy),
        "gpu_slots": sizes.soak_slots,
        "steps": counted,
        "median_ms": round(statistics.median(times), 4),
        "p99_ms": round(_quantile(times, 0.99), 4),
        "worst_ms": round(max(times), 4),
        "mean_ms": round(statistics.fmean(times), 4),
        "wall_ms_per_step": round(wall / counted, 4),
        "misses_per_step": round((after["misses"] - before["misses"]) / counted, 1),
        "victims_per_step": round((after["victims"] - before["victims"]) / counted, 1),
        "hit_rate": round((after["hits"] - before["hits"]) / max(1, seen), 4),
        "kernels": _kernel_table(step, sizes.soak_profiled, device),
    }
    pool.check()
    return row


def _timed_steps(step, n: int, device: torch.device) -> tuple[list[float], float]:
    """Each step's time (ms) and the wall time of all of them (ms). On a GPU, events around each
    step, read once at the end: the host never waits between steps."""
    started = time.perf_counter()
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times, (time.perf_counter() - started) * 1e3
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    marks[0].record()
    for i in range(n):
        step()
        marks[i + 1].record()
    torch.cuda.synchronize(device)
    wall = (time.perf_counter() - started) * 1e3
    return [marks[i].elapsed_time(marks[i + 1]) for i in range(n)], wall


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _kernel_table(step, n: int, device: torch.device) -> list[dict]:
    """Per kernel: launches a step and mean microseconds a launch, over ``n`` steps (CUDA only)."""
    if device.type != "cuda" or n == 0:
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize(device)
    table = []
    for event in prof.key_averages():
        if event.device_time_total > 0 and event.count > 0:
            table.append(
                {
                    "kernel": event.key[:60],
                    "per_step": round(event.count / n, 2),
                    "us_per_launch": round(event.device_time_total / event.count, 2),
                }
            )
    return sorted(table, key=lambda r: -r["us_per_launch"] * r["per_step"])


def whole_step(device: torch.device, sizes: ServingSizes) -> list[dict]:
    """One decode step of ``step_groups`` one-layer groups, as a write of the batch's new tokens and
    a prepare each ("apart"), and as one plan each (``prepare(..., new=NewRows(...))``): its
    launches counted, run eagerly and, on CUDA, captured whole in one CUDA graph and replayed on
    fresh selections and new tokens: the replayed slots hold their bytes."""
    return [_whole_step(device, sizes, one_plan) for one_plan in (False, True)]


def _whole_step(device: torch.device, sizes: ServingSizes, one_plan: bool) -> dict:
    groups, batch, k = sizes.step_groups, sizes.step_batch, sizes.topk
    replays = 3
    context = 4 * sizes.step_slots // batch
    total = batch * (context + replays + 3)
    pool = _pool(device, groups, sizes.step_slots, total - sizes.step_slots + batch, PBLRU(8))
    reqs = _Requests(pool, batch, context, replays + 2)
    kv = SparseKV(pool, max_batch=batch, top_k=k)
    trace = DecodeTrace(batch, k, reqs.lengths, seed=11)
    new = torch.empty(batch, dtype=torch.int64, device=device)
    selection = torch.empty((batch, k), dtype=torch.int64, device=device)

    def next_inputs() -> None:  # outside the graph: the engine's scheduler and indexer
        new.copy_(reqs.new_tokens())
        reqs.lengths += 1
        selection.copy_(reqs.addresses(trace.step()))

    def step() -> list:
        out = []
        for g in range(groups):
            if one_plan:
                out.append(kv.prepare(g, selection, new=NewRows(g, new, reqs.rows)))
            else:
                kv.write(g, new, reqs.rows)
                out.append(kv.prepare(g, selection))
        kv.join()
        return out

    next_inputs()
    with count_launches() as launched:
        step()
    started = time.perf_counter()
    next_inputs()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    eager_ms = (time.perf_counter() - started) * 1e3
    result = {
        "calls": "one plan" if one_plan else "write + prepare",
        "groups": groups,
        "batch": batch,
        "topk": k,
        "launches": len(launched),
        "eager_ms": round(eager_ms, 3),
    }
    if device.type != "cuda":
        result["captured"] = "skipped: needs CUDA"
        pool.check()
        return result
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    checked = 0
    replay_ms = []
    for _ in range(replays):
        next_inputs()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        replay_ms.append(start.elapsed_time(end))
        pool.check()
        for g in (0, groups - 1):
            got = pool.gpu_buffer(g)[captured[g].slots.long()].cpu()
            want = pool.read(g, selection.reshape(-1)).reshape(got.shape).cpu()
            if not torch.equal(got, want):
                raise AssertionError(f"whole-step replay: group {g}'s slots do not hold their bytes")
            checked += got.shape[0] * got.shape[1]
    pool.check_invariants()
    return {
        **result,
        "captured": "replayed correctly",
        "rows_checked": checked,
        "replay_ms": round(min(replay_ms), 3),
    }
