"""One compilation per configuration: a serving loop compiles no new kernel variant after its first step.

Triton compiles a kernel once per specialisation key: argument types, constexpr values, integers
equal to 1 or divisible by 16, pointers 16-byte aligned (minus what ``do_not_specialize`` and
``do_not_specialize_on_alignment`` exclude). A key first met mid-serving costs about 4 s of compile
on a GPU, or breaks a CUDA-graph capture. The loops below vary what an engine varies from step to
step (batch 1..256, every layer group, the last one short, prefill lengths, decode writes, the
prefetch split, releases, reads; on an engine-owned pool, the engine's slots made live and freed at
any offset of its buffers, and FlashInfer's layout of the slots) and count the distinct keys per
kernel that a GPU would compile.

No GPU is needed: a subprocess with TRITON_INTERPRET=0 drives the pool, and every launch stops
inside Triton's own ``JITFunction.run`` right where it would compile
(``ulakv.kernels.compile_check.intercept_launches``), so the keys are Triton's, for an sm_90
target. Kernels do not run there, so pool state does not evolve; the keys depend only on what the
host passes (counts, offsets, views), which is all a serving loop varies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each step's batch (live requests); the first is the warm-up an engine would run before serving.
BATCHES = (5, 1, 2, 3, 7, 16, 64, 255, 256, 33, 1)
# Adapter buffers sized for 257 requests x 3 queries x 3: 2313 selection elements a group (odd), so
# each group's row of SparseKV's slots buffer starts at a different 16-byte alignment.
MAX_BATCH, QUERIES, TOP_K = 257, 3, 3
LAYERS, PER_GROUP = 5, 2  # groups of 2, 2 and 1 layers
GPU_SLOTS = 61  # 62 rows a layer: with 20- or 6-byte rows, layers (and groups) start at varying alignment
MAX_PROMPT = 12


def _probe_kernels():
    """A kernel with one int and one pointer, plain and unspecialised: shows that what the
    interception records follows Triton's rules (=1, divisible by 16, 16-byte alignment)."""
    from ulakv.kernels._triton import tl, triton

    def probe(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    return triton.jit(probe), triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["x_ptr"])(
        probe
    )


def _serve(policy, width: int, on_step) -> None:
    """A serving loop through the engine adapter; ``on_step(step)`` after each step."""
    import random

    import torch

    from ulakv import EntrySpec, Pool, PoolConfig, Tiered
    from ulakv.engine import SparseKV

    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=width),
            num_layers=LAYERS,
            layers_per_group=PER_GROUP,
            layout=Tiered(gpu_slots=GPU_SLOTS, cpu_slots=8192, policy=policy),
            validate=False,
        )
    )
    kv = SparseKV(pool, max_batch=MAX_BATCH, top_k=TOP_K, max_queries=QUERIES, prefetch=True)
    rng = random.Random(width)
    # The engine's buffers, sliced per step: the indexer's top-k (one block a group), the prefill's
    # and the decode's new rows (one block a layer).
    topk = torch.full((pool.num_groups, MAX_BATCH, QUERIES, TOP_K), -1, dtype=torch.int32)
    prefill = torch.zeros((LAYERS, MAX_BATCH * MAX_PROMPT + 8, width), dtype=torch.uint8)
    decode = torch.zeros((LAYERS, MAX_BATCH, width), dtype=torch.uint8)
    live: list = []
    for step, batch in enumerate(BATCHES):
        while len(live) > batch:
            kv.release(live.pop(0))
        arrivals = [pool.admit(rng.randint(1, MAX_PROMPT)) for _ in range(batch - len(live))]
        if arrivals:  # one prefill write a layer for every new request's tokens
            addrs = torch.cat([seq.addresses for seq in arrivals])
            start = rng.randrange(8)
            for layer in range(LAYERS):
                kv.write(layer, addrs, prefill[layer, start : start + addrs.numel()])
            live += arrivals
        for group in range(pool.num_groups):  # a decode step: every group's selection, split as on a GPU
            for b, seq in enumerate(live):
                for q in range(QUERIES):
                    picks = rng.sample(seq.address_list, min(TOP_K, len(seq)))
                    topk[group, b, q] = torch.tensor(picks + [-1] * (TOP_K - len(picks)))
            kv.prepare(group, topk[group, :batch])
        new = torch.cat([pool.extend(seq, 1) for seq in live])  # the step's token, every layer
        for layer in range(LAYERS):
            kv.write(layer, new, decode[layer, :batch])
        pool.read(step % LAYERS, new[:3])  # the slow path, one layer a step
        kv.release(live.pop(rng.randrange(len(live))))  # a request finishes
        on_step(step)


def _serve_buffer(policy, width: int, on_step) -> None:
    """A striped rank's buffer (victims dropped, misses from fetched rows) through its layout, as
    ``StripedPool.prepare`` drives it: varying selections, every group, a refused plan's run."""
    import torch

    from ulakv import EntrySpec, PoolConfig, Tiered
    from ulakv.kernels.operands import readable_rows
    from ulakv.layouts.tiered_state import BufferState, TieredRunner

    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=width),
        num_layers=LAYERS,
        layers_per_group=PER_GROUP,
        layout=Tiered(gpu_slots=GPU_SLOTS, cpu_slots=0, policy=policy),
        validate=False,
    )
    state = BufferState.allocate(cfg, addresses=4096)
    layout = TieredRunner(cfg, state)
    for step, batch in enumerate(BATCHES):
        for group in range(cfg.num_groups):
            T = batch * QUERIES * TOP_K
            plan, _ = layout.plan(group, torch.arange(T, dtype=torch.int64) % 4096)
            misses = 1 + (batch * 7) % 50
            rows = torch.zeros((misses, len(cfg.group_layers(group)), width), dtype=torch.uint8)
            if step % 3 == 2:  # a refused plan: run with the scratch as stand-in rows
                layout.execute(plan, fetched=plan.scratch.victims)
            else:
                layout.execute(plan, fetched=readable_rows(rows))
        on_step(step)


def _serve_striped(policy, width: int, on_step) -> None:
    """A fetch-mode striped rank's census and fetch bookkeeping around its buffer's plan, as
    ``StripedPool.prepare`` drives them (no process group: the collective moves nothing the keys
    depend on): int32 selections at any offset of the engine's buffer, every group, a write's and a
    local-mode census, a refused call's plan."""
    import torch

    from ulakv import EntrySpec, PoolConfig, Tiered
    from ulakv.kernels.operands import readable_rows
    from ulakv.layouts.census import CensusState
    from ulakv.layouts.row_exchange import RowExchange
    from ulakv.layouts.tiered_state import BufferState, TieredRunner

    cfg = PoolConfig(
        entry=EntrySpec(bytes_per_layer=width),
        num_layers=LAYERS,
        layers_per_group=PER_GROUP,
        layout=Tiered(gpu_slots=GPU_SLOTS, cpu_slots=0, policy=policy),
        validate=False,
    )
    state = BufferState.allocate(cfg, addresses=4096)
    layout = TieredRunner(cfg, state)
    census = CensusState(3, 1, 4096, torch.device("cpu"))
    exchange = RowExchange(3, 1, 40, PER_GROUP, width, torch.device("cpu"))
    live = torch.ones(4096, dtype=torch.bool)
    topk = torch.arange(MAX_BATCH * QUERIES * TOP_K + 8, dtype=torch.int32) % 4096
    for step, batch in enumerate(BATCHES):
        T = batch * QUERIES * TOP_K
        flat = topk[step % 5 : step % 5 + T]  # the step's selection starts anywhere in the buffer
        census.take(flat, live=live, unique=True)  # a write's
        census.take(flat, live=live, per_home=40)  # a local-mode prepare's, or a read's
        for group in range(cfg.num_groups):
            found = census.take(
                flat, live=live, per_home=40, most=GPU_SLOTS, buffer_map=state.mapping[group],
                buffer_slots=GPU_SLOTS, fetch_width=40,
            )  # fmt: skip
            plan, _ = layout.plan(group, flat, out=exchange.buffer_slots_for(T))
            slots = torch.zeros(T, dtype=torch.int32)
            _, fetch_rows, _ = exchange.route(flat, plan.scratch, slots, GPU_SLOTS)
            _, gathered = exchange.views(len(cfg.group_layers(group)))
            layout.execute(plan, fetched=readable_rows(gathered), fetch_rows=fetch_rows)
            exchange.merge_slots(found.local, slots, GPU_SLOTS + 1)
        on_step(step)


def _serve_engine(policy, width: int, on_step) -> None:
    """An engine-owned pool as the SGLang store drives it: the engine's own slots (``loc``, int64
    views of its ``out_cache_loc`` buffer; 0 its padding) made live each step, written, selected
    (int32 ``[B, Q, K]`` from the engine's page table), laid out for FlashInfer into fixed buffers,
    and freed as requests finish."""
    import random

    import torch

    from ulakv import compact_slots
    from ulakv.integrations.sglang.store import SGLangStore, StoreConfig

    store = SGLangStore(
        StoreConfig(
            layers=LAYERS,
            bytes_per_token=width,
            device_tokens=GPU_SLOTS,
            logical_tokens=4096,
            max_batch=MAX_BATCH,
            max_queries=QUERIES,
            top_k=TOP_K,
            layers_per_group=PER_GROUP,
            policy=policy,
            validate=False,
        )
    )
    rng = random.Random(width)
    free = list(range(1, 4096))  # loc 0 is the engine's padding slot
    rng.shuffle(free)
    out_cache_loc = torch.zeros(MAX_BATCH * MAX_PROMPT + 8, dtype=torch.int64)
    rows = torch.zeros((LAYERS, MAX_BATCH * MAX_PROMPT + 8, width), dtype=torch.uint8)
    topk = torch.zeros((MAX_BATCH, QUERIES, TOP_K), dtype=torch.int32)
    flashinfer = torch.empty((MAX_BATCH, QUERIES, TOP_K), dtype=torch.int32)
    counts = torch.empty((MAX_BATCH, QUERIES), dtype=torch.int32)
    live: list[list[int]] = []

    def make_live(locs: list[int]) -> None:
        start = rng.randrange(8)  # the step's tokens start anywhere in the engine's buffer
        loc = out_cache_loc[start : start + len(locs)]
        loc.copy_(torch.tensor(locs))
        store.admit(loc)
        for layer in range(LAYERS):
            store.write(layer, loc, rows[layer, start : start + len(locs)])

    for step, batch in enumerate(BATCHES):
        while len(live) > batch:
            store.release(torch.tensor(live.pop(0)))
        arrivals = [[free.pop() for _ in range(rng.randint(1, MAX_PROMPT))] for _ in range(batch - len(live))]
        if arrivals:  # one prefill for every new request's tokens
            make_live([loc for request in arrivals for loc in request])
            live += arrivals
        for b, request in enumerate(live):
            for q in range(QUERIES):
                picks = rng.sample(request, min(TOP_K, len(request)))
                topk[b, q] = torch.tensor(picks + [0] * (TOP_K - len(picks)))
        for layer in range(LAYERS):  # the first layer of a group prepares it, the others wait
            slots = store.slots(layer, topk[:batch])
            compact_slots(slots, out=flashinfer[:batch], counts=counts[:batch])
        new = [free.pop() for _ in live]  # the step's token
        make_live(new)
        for request, loc in zip(live, new, strict=True):
            request.append(loc)
        finished = live.pop(rng.randrange(len(live)))
        store.release(torch.tensor(finished))
        free += finished
        on_step(step)


def _unknown_exclusions() -> dict[str, list[str]]:
    """Names in a kernel's ``do_not_specialize`` lists that are none of its parameters (Triton
    ignores them silently: a typo would bring the variants back)."""
    from triton.runtime.jit import JITFunction

    from ulakv.kernels import (
        apply,
        buckets,
        census,
        compact,
        engine_addresses,
        exchange,
        gather,
        lookup,
        release,
    )

    unknown = {}
    for module in (apply, buckets, census, compact, engine_addresses, exchange, gather, lookup, release):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                params = {p.name for p in fn.params}
                listed = [*fn.do_not_specialize, *fn.do_not_specialize_on_alignment]
                if bad := [n for n in listed if n not in params]:
                    unknown[name] = bad
    return unknown


def _main() -> None:
    """In the subprocess: print a JSON report of distinct keys per case and kernel."""
    import torch

    from ulakv import PBLRU, ExactLRU
    from ulakv.kernels.compile_check import intercept_launches

    keys: dict[str, set[str]] = defaultdict(set)

    def record(fn, key: str, _compile: dict) -> None:
        keys[fn.fn.__name__].add(key)

    report: dict = {"probe": {}, "cases": {}, "unknown": _unknown_exclusions()}
    with intercept_launches(90, record):
        plain, unspecialised = _probe_kernels()
        x = torch.zeros(64, dtype=torch.int32)
        for kernel in (plain, unspecialised):
            keys.clear()
            for view in (x, x[1:], x[4:]):  # 16-byte aligned, not, aligned
                for n in (1, 7, 16, 32, 33):  # =1, neither, divisible by 16 (twice), neither
                    kernel[(1,)](view, n, BLOCK=16)
            report["probe"][kernel.fn.__name__ + ("" if kernel is plain else "_unspecialised")] = sorted(
                keys["probe"]
            )
        cases = [
            ("lru_words20", _serve, ExactLRU(), 20),
            ("pblru_words20", _serve, PBLRU(4), 20),
            ("lru_bytes6", _serve, ExactLRU(), 6),
            ("pblru_words64", _serve, PBLRU(4), 64),
            ("buffer_lru_words20", _serve_buffer, ExactLRU(), 20),
            ("buffer_pblru_bytes6", _serve_buffer, PBLRU(4), 6),
            ("striped_lru_words20", _serve_striped, ExactLRU(), 20),
            ("engine_lru_words20", _serve_engine, ExactLRU(), 20),
            ("engine_pblru_bytes6", _serve_engine, PBLRU(4), 6),
        ]
        for name, serve, policy, width in cases:
            keys.clear()
            first: dict[str, list[str]] = {}

            def on_step(step: int, first=first) -> None:
                if step == 0:
                    first.update({k: sorted(v) for k, v in keys.items()})

            serve(policy, width, on_step)
            report["cases"][name] = {
                kernel: {"first": first.get(kernel, []), "end": sorted(found)}
                for kernel, found in keys.items()
            }
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_interception_follows_tritons_specialisation(report: dict) -> None:
    """The plain probe compiles 3 x 2 variants (n: =1 / divisible by 16 / neither; x: aligned or
    not); with both exclusions, one."""
    plain, unspecialised = report["probe"]["probe"], report["probe"]["probe_unspecialised"]
    assert len(plain) == 6, plain
    assert any("('i32', 'D')" in k and "('*i32', 'D')" in k for k in plain), plain
    assert any("('constexpr', 1)" in k for k in plain), plain
    assert len(unspecialised) == 1, unspecialised
    assert "('i32', None)" in unspecialised[0] and "('*i32', '')" in unspecialised[0], unspecialised


def test_exclusions_name_parameters(report: dict) -> None:
    assert report["unknown"] == {}


def test_no_new_kernel_variant_after_the_first_step(report: dict) -> None:
    """Per configuration, the kernel variants the first step compiles are all the loop ever needs."""
    counts = {
        case: {kernel: (len(v["first"]), len(v["end"])) for kernel, v in sorted(kernels.items())}
        for case, kernels in report["cases"].items()
    }
    grown = {
        case: {kernel: counts[case][kernel] for kernel, v in kernels.items() if v["first"] != v["end"]}
        for case, kernels in report["cases"].items()
    }
    grown = {case: kernels for case, kernels in grown.items() if kernels}
    assert not grown, f"variants (after the first step, at the end) that grew: {grown}; all: {counts}"
    # classify: a prepare's variant and a write's, whichever group (its report word, 8 bytes a group,
    # is not 16-byte aligned for odd groups) and whatever the call's size.
    classify = {
        case: counts[case]["classify_kernel"][1] for case in counts if "classify_kernel" in counts[case]
    }
    assert all(n <= 2 for n in classify.values()), classify
    # The loop met every kernel a serving pool launches.
    met = {kernel for kernels in report["cases"].values() for kernel in kernels}
    assert met == {
        "claim_kernel",
        "classify_kernel",
        "decide_kernel",
        "apply_kernel",
        "gather_kernel",
        "release_kernel",
        "engine_addresses_kernel",
        "mark_live_kernel",
        "compact_kernel",
        "round_end_kernel",
        "census_kernel",
        "homes_kernel",
        "place_kernel",
        "slots_kernel",
    }


if __name__ == "__main__":
    _main()
