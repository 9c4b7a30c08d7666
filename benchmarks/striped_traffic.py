"""Striped pools: bytes each rank receives per group-step, fetch mode against local attention.

    python benchmarks/striped_traffic.py [--batches 1 16 64] [--worlds 2 4 8] [--steps 2]
        [--buffer 1.5] [--model glm-5] [--budget-mb 128] [--seed 0]

Everything runs on gloo processes (``ulakv.spawn.run_ranks``, CPU, kernels under the Triton
interpreter when no GPU is present); every number is per rank and per group-step (one selection
serves the ``layers_per_group`` layers of a group: the model's ``indexer_every``).

- ``attention="fetch"``: every rank runs a real striped pool (exact-LRU buffer of ``--buffer`` x the
  step's working set, the default ``fetch_rows``) over a synthetic DSA-shaped trace: ``batch``
  requests with 64K-128K-token histories decoding together, each selecting top-2048 positions a
  step with one query position (``SyntheticSpec(queries=1, heavy=256)``, as
  ``ulakv.capacity.default_selection_shape``). Each step appends and writes a token per request,
  then prepares the step's ``[batch, 2048]`` selection. Step 0 fills the empty buffer (a warm-up);
  the later steps are measured. Reported: the wire bytes (``stats()["bytes_communicated"]``,
  padding included), the bytes the operating system saw this rank write to its gloo sockets during
  the prepare (an all-gather is symmetric: what a rank sends is what it receives, plus gloo's
  framing), and ``bytes_needed`` (rows that carried a miss homed on another rank).
- ``attention="local"`` (decode context parallelism): ``prepare`` moves nothing; the engine moves
  the queries and the partial outputs. With heads split across the ranks (tensor parallelism, as
  vLLM's DCP reuses the TP group) each rank all-gathers the other ranks' heads' absorbed MLA queries
  (``kv_lora_rank + qk_rope_dim`` bf16 a head), attends with every head over its part, and the ranks
  exchange the bf16 partial outputs (``kv_lora_rank`` a head: attention runs in the latent space)
  and float32 LSEs with ``ulakv.engine.context_parallel.all_gather_partials``. Both all-gathers run
  on gloo with these shapes, their contents are checked, and the socket bytes are counted. vLLM's
  combine (all-gather the LSEs, reduce-scatter the outputs by head) is given by its formula.

Cost under the interpreter: a batch-64 prepare (131 K elements) takes one rank 80-100 s of CPU
and every rank runs it, so the default run needs about 2,900 CPU-seconds (40 min on 2 shared
cores); ``--batches 1 16`` about a quarter of that. Steps are the knob to turn, not the shapes: two is
the least that measures a warm buffer.

Rows are 656 bytes (GLM-5 / DeepSeek-V3.2 FP8 latent) unless a rank's rows, send and gather buffers
would exceed ``--budget-mb``: then a configuration is measured with ``656 / 2^j`` bytes a row and
every fetch byte count is multiplied by ``2^j``. That scaling is exact: every one of them is a count
of rows times the row's bytes (the table says where it was used).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch
import torch.distributed as dist

from ulakv import EntrySpec, ExactLRU, Pool, PoolConfig, Striped, Tiered
from ulakv.engine.context_parallel import all_gather_partials, partial_bytes
from ulakv.presets import MODELS
from ulakv.spawn import run_ranks
from ulakv.traces import SyntheticSpec, synthetic

TOPK = 2048
ROW = 656  # FP8 latent row a token-layer: 512 fp8 + 4 fp32 scales + 64 bf16 rope
PROMPT = (65536, 131072)  # history lengths of the published workload (64K-128K inputs)
QUERIES = 1  # query positions a request and step (no speculative decoding)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def trace_spec(batch: int, steps: int, seed: int = 0) -> SyntheticSpec:
    """``batch`` requests decoding together for ``steps`` steps, top-2048 of one query position."""
    return SyntheticSpec(
        requests=batch,
        prompt=PROMPT,
        steps=steps,
        topk=TOPK,
        queries=QUERIES,
        groups=1,
        heavy=256,
        arrival_spread=0,
        seed=seed,
    )


def socket_bytes() -> int:
    """Bytes this process has written so far (``wchar`` of ``/proc/self/io``; gloo writes its
    sockets with ``write``/``writev``, which count there), or -1 where there is no such file."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def fetch_plan(world: int, batch: int, steps: int, buffer_scale: float, lpg: int, budget: int, seed: int):
    """Buffer, slice and row size of one fetch configuration (the same on every rank)."""
    trace = synthetic(trace_spec(batch, steps, seed))
    working = trace.working_set()
    buffer = math.ceil(buffer_scale * working)
    history = sum(r.prompt_len + r.steps for r in trace.requests)
    # A rank's GPU slice holds its share of the history, and never less than the buffer: in a
    # deployment it holds far more (about 10^6 rows a layer), so the default fetch width, the most
    # misses one home may have, is the buffer's size.
    slice_slots = max(-(-history // world), buffer)
    width = min(buffer, slice_slots)
    rows = lpg * (slice_slots + 1 + buffer + 1 + (world + 1) * width)  # pool rows, send, gathered
    row, scale = ROW, 1
    while row % 2 == 0 and rows * row > budget:
        row, scale = row // 2, scale * 2
    return dict(working=working, buffer=buffer, slice=slice_slots, width=width, row=row, scale=scale)


def _fetch_rank(rank: int, world: int, batch: int, plan: dict, steps: int, lpg: int, seed: int) -> dict:
    warnings.filterwarnings("ignore")  # nothing may write to stderr inside a measured prepare
    trace = synthetic(trace_spec(batch, steps, seed))
    row = plan["row"]
    layout = Striped(
        world=world,
        rank=rank,
        buffer_slots=plan["buffer"],
        policy=ExactLRU(),
        inner=Tiered(gpu_slots=plan["slice"], cpu_slots=0),
    )
    assert layout.fetch_width == plan["width"]
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=row),
            num_layers=lpg,
            layers_per_group=lpg,
            layout=layout,
            validate=False,
        )
    )
    # Histories are admitted, not written: the bytes counted do not depend on what the rows hold
    # (a prefill of 6 M tokens would take hours under the interpreter).
    seqs = [pool.admit(r.prompt_len) for r in trace.requests]
    keys = ("bytes_communicated", "bytes_needed", "hits", "misses", "collectives")
    last = {k: pool.stats()[k] for k in keys}
    out = []
    for step in range(steps):
        new = torch.cat([pool.extend(seq, 1) for seq in seqs])
        rows = torch.zeros((new.numel(), row), dtype=torch.uint8)
        for layer in range(lpg):
            pool.write(layer, new, rows)
        picks = []
        for seq, r in zip(seqs, trace.requests, strict=True):
            pos = r.topk[step, 0, 0].long()
            picks.append(torch.where(pos >= 0, seq.addresses[pos.clamp(min=0)], -1))
        topk = torch.stack(picks)
        distinct = topk[topk >= 0].unique()
        busiest = int(torch.bincount(distinct % world, minlength=world).max())
        start, wrote = time.perf_counter(), socket_bytes()
        pool.prepare(0, topk)
        wrote, seconds = socket_bytes() - wrote, time.perf_counter() - start
        now = {k: pool.stats()[k] for k in keys}
        out.append(dict({k: now[k] - last[k] for k in keys}, socket=wrote, seconds=seconds, busiest=busiest))
        last = now
    return dict(steps=out)


def _local_rank(rank: int, world: int, batch: int, heads: int, latent: int, rope: int, lpg: int) -> dict:
    """The engine's collectives of one group-step in local mode, on gloo, contents checked."""
    warnings.filterwarnings("ignore")
    q = torch.full((batch, QUERIES, heads // world, latent + rope), float(rank), dtype=torch.bfloat16)
    gathered = torch.empty((world, *q.shape), dtype=q.dtype)
    out = torch.full((batch, QUERIES, heads, latent), float(rank + 1), dtype=torch.bfloat16)
    lse = torch.full((batch, QUERIES, heads), float(rank) - 0.5, dtype=torch.float32)
    query_socket = partial_socket = 0
    for _ in range(lpg):
        dist.barrier()
        before = socket_bytes()
        _all_gather(gathered.view(-1), q.reshape(-1))
        middle = socket_bytes()
        outs, lses = all_gather_partials(out, lse, world)
        partial_socket += socket_bytes() - middle
        query_socket += middle - before
        for r in range(world):
            assert bool((gathered[r] == r).all()) and bool((outs[r] == r + 1).all())
            assert bool((lses[r] == r - 0.5).all())
    own_partial = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    return dict(
        query=lpg * (gathered.numel() - q.numel()) * q.element_size(),
        partial=lpg * (world - 1) * own_partial,
        query_socket=query_socket,
        partial_socket=partial_socket,
    )


def size(n: float) -> str:
    """Bytes in decimal units (as the rest of RESULTS.md)."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measure(world: int, batch: int, args, model) -> dict:
    lpg = model.indexer_every
    plan = fetch_plan(world, batch, args.steps, args.buffer, lpg, args.budget_mb * 10**6, args.seed)
    started = time.perf_counter()
    ranks = run_ranks(_fetch_rank, world, batch, plan, args.steps, lpg, args.seed)
    fetch_seconds = time.perf_counter() - started
    # Step 0 fills an empty buffer: a warm-up, unless it is the only step.
    measured = [s for r in ranks for s in (r["steps"][1:] or r["steps"])]
    scale = plan["scale"]
    wire = {s["bytes_communicated"] for s in measured}
    assert len(wire) == 1, f"the fetch moved {wire} bytes: its size must not depend on the step"
    wire_bytes, wire_formula = wire.pop() * scale, (world - 1) * plan["width"] * lpg * ROW
    assert wire_bytes == wire_formula, (wire_bytes, wire_formula)
    assert all(s["collectives"] == 1 for s in measured)
    hits, misses = sum(s["hits"] for s in measured), sum(s["misses"] for s in measured)
    # The least fetch width that refuses no step of the trace (the cold step 0 included): the most
    # distinct selected addresses one rank homes, what a slice whose staging rows hold only a home's
    # share of a step (the capacity plan's) makes the default.
    home_width = max(s["busiest"] for r in ranks for s in r["steps"])
    assert model.heads % world == 0, "tensor parallelism splits the heads evenly"
    local = run_ranks(_local_rank, world, batch, model.heads, model.kv_lora_rank, model.qk_rope_dim, lpg)
    H, D, R, B = model.heads, model.kv_lora_rank, model.qk_rope_dim, batch * QUERIES
    query_formula = lpg * (world - 1) * B * (H // world) * (D + R) * 2
    partial_formula = lpg * partial_bytes(batch, QUERIES, H, D, world, element_bytes=2)
    assert all(r["query"] == query_formula and r["partial"] == partial_formula for r in local)
    vllm_formula = lpg * ((world - 1) * B * H * 4 + (world - 1) * B * (H // world) * D * 2)
    return dict(
        world=world,
        batch=batch,
        lpg=lpg,
        plan=plan,
        hit_rate=hits / (hits + misses),
        wire=wire_bytes,
        wire_formula=wire_formula,
        home_width=home_width,
        home_wire=(world - 1) * home_width * lpg * ROW,
        socket=mean([s["socket"] for s in measured]) * scale,
        needed=mean([s["bytes_needed"] for s in measured]) * scale,
        needed_range=(
            min(s["bytes_needed"] for s in measured) * scale,
            max(s["bytes_needed"] for s in measured) * scale,
        ),
        prepare_s=mean([s["seconds"] for s in measured]),
        fetch_s=fetch_seconds,
        query=query_formula,
        query_socket=mean([r["query_socket"] for r in local]),
        partial=partial_formula,
        partial_socket=mean([r["partial_socket"] for r in local]),
        vllm=vllm_formula,
    )


def tables(results: list[dict], model) -> list[str]:
    """Two markdown tables: the fetch mode's bytes, then local mode's beside them."""
    H, D, R = model.heads, model.kv_lora_rank, model.qk_rope_dim
    fetch = [
        "| ranks w | batch B | buffer slots (x working set) | fetch width W | buffer hit rate "
        f"| fetch wire = (w-1)·W·L·{ROW} | gloo sockets | fetch needed (rows; range over ranks) "
        "| needed / wire | W' = busiest home's share | wire at W' = (w-1)·W'·L·656 | needed / wire at W' |",
        "|" + "---|" * 12,
    ]
    local = [
        f"| ranks w | batch B | queries = (w-1)·B·(H/w)·{D + R}·2·L | gloo sockets "
        f"| partials = partial_bytes = (w-1)·B·H·({D}·2+4)·L | gloo sockets | local total "
        f"| vLLM combine = (w-1)·B·H·4·L + (w-1)·B·(H/w)·{D}·2·L | local total, vLLM combine "
        "| fetch wire / local total | fetch wire at W' / local total | fetch needed / local total |",
        "|" + "---|" * 12,
    ]
    for r in results:
        p, w, B, L = r["plan"], r["world"], r["batch"], r["lpg"]
        scaled = f" (rows of {p['row']} B, x{p['scale']})" if p["scale"] > 1 else ""
        lo, hi = r["needed_range"]
        total, total_vllm = r["query"] + r["partial"], r["query"] + r["vllm"]
        fetch.append(
            f"| {w} | {B} | {p['buffer']} ({p['buffer'] / p['working']:.2g}x of {p['working']}) "
            f"| {p['width']} | {r['hit_rate']:.1%} "
            f"| {size(r['wire'])} = {w - 1}·{p['width']}·{L}·{ROW}{scaled} | {size(r['socket'])} "
            f"| {size(r['needed'])} ({r['needed'] / (L * ROW):.0f}; {size(lo)} to {size(hi)}) "
            f"| {r['needed'] / r['wire']:.1%} | {r['home_width']} "
            f"| {size(r['home_wire'])} = {w - 1}·{r['home_width']}·{L}·{ROW} "
            f"| {r['needed'] / r['home_wire']:.1%} |"
        )
        local.append(
            f"| {w} | {B} | {size(r['query'])} = {w - 1}·{B}·{H // w}·{D + R}·2·{L} "
            f"| {size(r['query_socket'])} | {size(r['partial'])} = {w - 1}·{B}·{H}·{2 * D + 4}·{L} "
            f"| {size(r['partial_socket'])} | {size(total)} "
            f"| {size(r['vllm'])} = {w - 1}·{B}·{H}·4·{L} + {w - 1}·{B}·{H // w}·{D}·2·{L} "
            f"| {size(total_vllm)} | {r['wire'] / total:.3g} | {r['home_wire'] / total:.3g} "
            f"| {r['needed'] / total:.3g} |"
        )
    return [*fetch, "", *local]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=2, help="decode steps; the first warms the buffer")
    parser.add_argument("--buffer", type=float, default=1.5, help="buffer slots, x one step's working set")
    parser.add_argument("--model", choices=sorted(MODELS), default="glm-5")
    parser.add_argument("--budget-mb", type=int, default=128, help="a rank's row bytes before rows shrink")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every configuration's figures here as they come")
    args = parser.parse_args()
    model = MODELS[args.model]
    started = time.perf_counter()
    results = []
    for batch in args.batches:
        for world in args.worlds:
            r = measure(world, batch, args, model)
            results.append(r)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
            print(
                f"# w={world} B={batch}: fetch run {r['fetch_s']:.0f} s "
                f"({r['prepare_s']:.1f} s a measured prepare, mean over ranks)",
                flush=True,
            )
    print(
        f"\n{model.name}: H = {model.heads} heads, latent {model.kv_lora_rank} + rope {model.qk_rope_dim}, "
        f"L = {model.indexer_every} layer(s) a group, top-k {TOPK}, {QUERIES} query position, "
        f"{args.steps} steps (step 0 warms the buffer), total {time.perf_counter() - started:.0f} s\n"
    )
    print("\n".join(tables(results, model)))


if __name__ == "__main__":
    main()
