"""Capacity fitter: how many long requests each system admits on 8 GPUs, counted by real pools.

Every number comes from pools built on the ``meta`` device with real budgets: the model sizes
each system's pools from the bytes their tensors take (measured on the meta pools, never a formula
of ours that could drift from the code), then admits requests of the published workload until one
does not fit. A system admits a batch of ``N`` only if all three hold:

- the ``N`` requests (full length: input plus every output token) are admitted by its pools;
- its GPU tensors fit the GPU budget and its CPU tensors the CPU budget;
- one decode step's working set fits: the union of the ``N`` requests' selections in a layer group
  (3 query positions with speculative decoding) fits the pool's ``max_selection`` (ulakv: GPU slots
  and staging rows; striped: the buffer in fetch mode, and each home's share; CPU offload: each
  request's quota).

Systems (per GPU budgets are equal for all five):

===============  ===================================================  ==============================
system           data parallel (each rank its own requests)           tensor parallel (one batch)
===============  ===================================================  ==============================
``gpu_only``     ``Tiered`` GPU only (SGLang)                          ``Replicated(world)``
``cpu_offload``  ``CPUOffloadBaseline`` (HiSparse)                     one ``CPUOffloadBaseline``
                                                                       replica on every rank
``dcp``          ``gpu_only``'s pools (a DCP group of one rank)        ``Striped(attention="local")``
                                                                       over a GPU-only ``Tiered``
``ulakv``        ``Tiered`` GPU + CPU, PB-LRU                          ``Striped`` (fetch) over
                                                                       ``Tiered``
``ulakv_local``  ``ulakv``'s pools (a DCP group of one rank)           ``Striped(attention="local")``
                                                                       over ``Tiered`` GPU + CPU
===============  ===================================================  ==============================

``dcp`` is decode context parallelism as vLLM and SGLang ship it: token ``t`` of every request on
rank ``t mod world``, each rank attends over its part and the partial outputs are merged by their
log-sum-exp; GPU only. Engines carve the DCP group out of the attention tensor-parallel group, and
DP attention runs attention on one rank: there ``dcp`` and ``ulakv_local`` are ``gpu_only`` and
``ulakv`` under another name.

``ulakv capacity --systems sglang`` compares SGLang as it serves DSA models instead: ``gpu_only``,
``cpu_offload`` (HiSparse), ``sglang_dcp`` (DCP with the indexer's keys of every token on every
rank, as SGLang keeps them) and ``sglang_dcp_ulakv`` (what ``SGLangDcpStore`` builds: that DCP with
ulakv's local mode under the latent rows); under DP attention the last two are ``gpu_only`` and
``ulakv``.

Index keys are always GPU-resident (the indexer scores every past position each step): a
GPU-only pool of their own beside each latent pool, replicated under TP for ``gpu_only`` and
``cpu_offload``, striped for ``dcp`` (as vLLM keeps them) and ulakv. ulakv is charged for every
byte of its tensors (mapping tables, policy state, call scratch); the baselines only for their KV
rows, which flatters them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch

from .config import PBLRU, CPUOffloadBaseline, EntrySpec, PoolConfig, Replicated, Striped, Tiered
from .errors import CapacityError
from .frame import MemoryReport
from .pool import Pool
from .presets import GB, HARDWARE, MODELS, HardwarePreset, ModelPreset

# -- the workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The published workload: long-document summarization, 64K-128K-token inputs."""

    input_tokens: tuple[int, int] = (65536, 131072)  # uniform, inclusive
    output_tokens: int = 2048
    seed: int = 0

    def lengths(self, stream: int, n: int) -> list[int]:
        """Full lengths (input + output) of the first ``n`` requests of seeded stream ``stream``
        (a request is admitted with room for every token it will generate: no preemption)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + stream)
        lo, hi = self.input_tokens
        return (torch.randint(lo, hi + 1, (n,), generator=gen) + self.output_tokens).tolist()


@dataclass(frozen=True)
class SelectionShape:
    """What one step's selections take, measured on a trace: the union of a request's query
    positions' selections in a group over ``topk`` (the largest seen), and the largest share of
    that union homed on one rank under striping (addresses ``t mod world``)."""

    union: float
    home_share: float
    source: str


def measure_selection_shape(trace, world: int, source: str) -> SelectionShape:
    """Largest union ratio and home share over every (request, step, group) of ``trace``.
    Positions stand in for addresses: a request's addresses are a shifted run, which permutes the
    homes and keeps the largest share."""
    union, share = 0.0, 0.0
    k = trace.topk
    for r in trace.requests:
        for step in range(r.steps):
            for g in range(r.topk.shape[1]):
                picks = r.topk[step, g].flatten()
                picks = picks[picks >= 0].unique()
                if picks.numel() == 0:
                    continue
                union = max(union, picks.numel() / k)
                per_home = torch.bincount(picks.long() % world, minlength=world)
                share = max(share, int(per_home.max()) / picks.numel())
    return SelectionShape(union=union, home_share=share, source=source)


def default_selection_shape(spec: bool, world: int = 8, topk: int = 2048) -> SelectionShape:
    """Measured on a seeded synthetic DSA trace at full scale (top-k 2048, 64K-128K prompts;
    3 query positions overlapping 90 % with speculation, 1 without)."""
    from .traces import SyntheticSpec, synthetic

    trace = synthetic(
        SyntheticSpec(
            requests=4, prompt=(65536, 131072), steps=8, topk=topk, queries=3 if spec else 1, heavy=256
        )
    )
    what = "3 query positions" if spec else "1 query position"
    return measure_selection_shape(
        trace, world, f"measured on a synthetic DSA trace (top-k {topk}, {what}, 4 requests x 8 steps)"
    )


@dataclass(frozen=True)
class Scenario:
    """One configuration: a model on ``world`` GPUs of one kind, in one mode, with or without
    speculative decoding, under one engine's memory settings."""

    model: ModelPreset
    hardware: HardwarePreset
    mode: str  # "TP" (attention split by heads, one batch) or "DP" (each rank its own requests)
    spec: bool
    world: int = 8
    mem_fraction_static: float = 0.88
    slots_per_request: int = 4096  # the CPU-offload baseline's GPU quota a request and layer group
    policy: PBLRU = field(default_factory=lambda: PBLRU(num_buckets=8))
    workload: Workload = field(default_factory=Workload)
    shape: SelectionShape | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("TP", "DP"):
            raise ValueError(f"mode must be 'TP' or 'DP', got {self.mode!r}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("mem_fraction_static must be in (0, 1]")

    @property
    def queries(self) -> int:
        return 3 if self.spec else 1

    @property
    def layers_per_group(self) -> int:
        return self.model.indexer_every

    def weights_per_gpu(self) -> int:
        w = self.model.weights(self.spec)
        if self.mode == "TP":
            return w // self.world
        attention = self.model.attention_weights(self.spec)
        return (w - attention) // self.world + attention

    def static_bytes(self) -> int:
        return int(self.hardware.hbm_bytes * self.mem_fraction_static)

    def kv_budget(self) -> int:
        """GPU bytes a rank has for KV, index keys and working buffers."""
        return self.static_bytes() - self.weights_per_gpu()

    def assumptions(self) -> list[tuple[str, str, str]]:
        """(what, value, source) for everything the count rests on."""
        m, hw, wl = self.model, self.hardware, self.workload
        shape = self.shape
        rows = [
            ("model", m.name, m.source),
            (
                "KV layers",
                f"{m.kv_layers(self.spec)} (MTP layer {'on' if self.spec else 'off'})",
                "one latent row a layer; the MTP layer that drafts keeps KV of its own",
            ),
            ("latent bytes a token-layer", str(m.latent_bytes), "FP8: 512 fp8 + 4 fp32 scales + 64 bf16"),
            (
                "index-key layers",
                f"{m.index_layers(self.spec)} x {m.index_key_bytes} B, GPU-resident",
                "docs/design.md, section 7: the indexer scores every past position each step",
            ),
            ("GPU", f"{hw.name}, {hw.hbm_bytes / GB:.0f} GB", hw.source),
            ("CPU budget a GPU", f"{hw.cpu_bytes / GB:.0f} GB", hw.source),
            ("GPUs", f"{self.world}, mode {self.mode}", "the published 8-GPU configurations"),
            (
                "static memory fraction",
                f"{self.mem_fraction_static}",
                "SGLang's mem_fraction_static covers weights + KV (its heuristic gives about 0.85-0.9 on "
                "141-288 GB GPUs; --mem-fraction to change); the rest: activations, CUDA graphs, NCCL",
            ),
            (
                "weights a GPU",
                f"{self.weights_per_gpu() / GB:.1f} GB",
                "checkpoint / world under TP; DP attention adds a full copy of the attention weights "
                f"({m.attention_weights(self.spec) / GB:.1f} GB) on every rank",
            ),
            (
                "requests",
                f"inputs uniform in {wl.input_tokens[0]}-{wl.input_tokens[1]} + {wl.output_tokens} output "
                f"tokens, seed {wl.seed}",
                "the published workload (Multi-LexSum, 64K-128K inputs)",
            ),
            (
                "CPU-offload GPU quota",
                f"{self.slots_per_request} entries a request and layer",
                "HiSparse's per-request GPU buffer (2 x top-k 2048); it must hold a step's union",
            ),
            (
                "DCP: latent KV",
                "token t on rank t mod world, GPU only (no CPU tier), no copies",
                "vLLM decode_context_parallel_size and SGLang --dcp-size (docs.sglang.io, Decode Context "
                "Parallelism): each rank attends over its part, partial outputs merged by their LSE",
            ),
            (
                "DCP: index keys",
                "striped like the latent KV (flatters dcp)",
                "vLLM shards the indexer K cache with the KV and merges the ranks' top-k candidates "
                "(vllm-project/vllm#46076, merged; --dcp-sparse-indexer-mode exact|union); SGLang's DSA "
                "DCP proposals keep it whole on every rank (sgl-project/sglang#18167, #31821), which "
                "would cost dcp more GPU memory",
            ),
            (
                "DCP under DP attention",
                "a group of one rank: dcp = gpu_only, ulakv_local = ulakv",
                "the DCP group is carved out of the attention TP group (vLLM: tp_size divisible by the "
                "DCP size; SGLang: ranks of an existing TP group); DP attention runs attention TP 1",
            ),
        ]
        if shape is not None:
            rows.append(
                (
                    "step working set",
                    f"union {max(1.0, shape.union):.3f} x top-k {m.topk} a request and group; largest "
                    f"home share {shape.home_share:.3f}",
                    shape.source,
                )
            )
        return rows


# -- measuring pools ----------------------------------------------------------------------------


def pool_bytes(pool, index: bool = False) -> MemoryReport:
    """What ``pool``'s tensors take (``memory()``; a meta pool's are measured without being
    allocated); an index-key pool's rows count as ``gpu_index``."""
    b = pool.memory()
    if index:  # index keys are scored where they live: all their rows are index rows
        b.gpu_index, b.gpu_rows, b.gpu_buffers = b.gpu_rows + b.gpu_buffers, 0, 0
    return b


def _reserve(pool, elements: int) -> None:
    """Size a pool's call scratch for one step's selection, as a serving loop would."""
    if elements > 0:
        pool.reserve_scratch(elements)


def _admits(pools: list, lengths: list[int]) -> bool:
    """Whether every pool admits every request (each pool holds one part of each request)."""
    for n in lengths:
        for pool in pools:
            try:
                pool.admit(n)
            except CapacityError:
                return False
    return True


def _largest(feasible: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest ``n`` in ``[0, limit]`` with ``feasible(n)``, for ``feasible`` true up to some
    point and false after (exponential search, then bisection)."""
    if not feasible(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and feasible(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _fit_slots(build: Callable[[int], object], budget: int, cost: Callable[[object], int]) -> int:
    """The most GPU slots ``s`` whose pool ``build(s)`` costs at most ``budget`` GPU bytes, from
    the costs of real meta pools (they grow linearly in ``s``, up to a few words of rounding)."""
    small, large = 4096, 8192
    per_slot = (cost(build(large)) - cost(build(small))) / (large - small)
    base = cost(build(small)) - per_slot * small
    s = int((budget - base) // per_slot)
    while s >= 1:
        over = cost(build(s)) - budget
        if over <= 0:
            return s
        s -= max(1, math.ceil(over / per_slot))
    return 0


# -- the five systems ---------------------------------------------------------------------------


@dataclass
class SystemFit:
    """One system in one scenario: requests admitted and what a GPU holds at that batch."""

    system: str
    admitted: int
    per_rank: list[int]
    bytes_per_gpu: MemoryReport
    pools: list[str]
    limit: str  # what stopped one more request
    held: int = 0  # distinct tokens its latent pools admit, all ranks together
    pays: str = ""  # what the system spends besides each token's one row: copies, wire, merges

    def breakdown(self, scenario: Scenario) -> dict[str, float]:
        """GB a GPU (and its CPU budget) holds, by purpose, at the admitted batch."""
        b = self.bytes_per_gpu
        return {
            "weights_gb": scenario.weights_per_gpu() / GB,
            "kv_budget_gb": scenario.kv_budget() / GB,
            "kv_rows_gb": b.gpu_rows / GB,
            "buffers_gb": b.gpu_buffers / GB,
            "index_keys_gb": b.gpu_index / GB,
            "metadata_gb": b.gpu_meta / GB,
            "cpu_budget_gb": scenario.hardware.cpu_bytes / GB,
            "cpu_rows_gb": b.cpu_rows / GB,
            "cpu_staging_gb": b.cpu_staging / GB,
        }


class _Fit(NamedTuple):
    """One system's pools for a batch: whether it fits, what they take, and why not more."""

    ok: bool
    bytes: MemoryReport
    pools: list[str]
    limit: str
    layout: object = None  # the latent pool's layout (None when none was built)


def _local(world: int, inner: Tiered) -> Striped:
    """Rank 0 of a decode-context-parallel pool (``t mod world``); every rank holds as much,
    give or take one token a request."""
    return Striped(world=world, rank=0, attention="local", inner=inner)


class _Fitter:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        m = sc.model
        self.kv_layers = m.kv_layers(sc.spec)
        self.index_layers = m.index_layers(sc.spec)
        self.latent_row = self.kv_layers * m.latent_bytes  # a token's latent rows, every layer
        self.index_row = self.index_layers * m.index_key_bytes
        shape = sc.shape or default_selection_shape(sc.spec, sc.world, m.topk)
        self.shape = shape
        # Distinct entries a request selects in a group: a real indexer picks exactly top-k, so at
        # least that many (a synthetic trace may pad a few duplicates with -1).
        self.union = math.ceil(max(1.0, shape.union) * m.topk)
        self._searched: dict[str, tuple[list[int], _Fit, str, int]] = {}

    def latent_config(self, layout) -> PoolConfig:
        return PoolConfig(
            entry=EntrySpec(self.sc.model.latent_bytes),
            num_layers=self.kv_layers,
            layers_per_group=self.sc.layers_per_group,
            layout=layout,
            device="meta",
        )

    def index_config(self, layout) -> PoolConfig:
        # Index keys never move: one group (one mapping) serves every indexer layer.
        return PoolConfig(
            entry=EntrySpec(self.sc.model.index_key_bytes),
            num_layers=self.index_layers,
            layers_per_group=self.index_layers,
            layout=layout,
            device="meta",
        )

    def lengths(self, stream: int, n: int) -> list[int]:
        return self.sc.workload.lengths(stream, n)

    def streams(self) -> list[int]:
        """Request streams: one a rank in DP mode, one for the whole group in TP mode."""
        return list(range(self.sc.world)) if self.sc.mode == "DP" else [0]

    def same_as(self, system: str) -> str:
        """The system whose pools ``system`` builds: under DP attention a DCP group is one rank, so
        ``dcp`` is ``gpu_only`` and ``ulakv_local`` is ``ulakv``."""
        if self.sc.mode == "DP":
            same = {
                "dcp": "gpu_only",
                "ulakv_local": "ulakv",
                "sglang_dcp": "gpu_only",
                "sglang_dcp_ulakv": "ulakv",
            }
            return same.get(system, system)
        return system

    # Each system: ``feasible(stream, n) -> _Fit`` for a batch of n.
    def gpu_only(self, stream: int, n: int) -> _Fit:
        # TP: every rank a replica of the whole batch's KV; DP: each rank a GPU-only pool.
        sc = self.sc
        if sc.mode == "TP":
            return self._rows_only(stream, n, lambda s: Replicated(world=sc.world, gpu_slots=s), "")
        return self._rows_only(stream, n, lambda s: Tiered(gpu_slots=s), "")

    def dcp(self, stream: int, n: int) -> _Fit:
        # Every rank ceil(length / world) of each request, GPU only; index keys striped alike.
        if self.sc.mode == "DP":
            return self.gpu_only(stream, n)
        world = self.sc.world
        return self._rows_only(stream, n, lambda s: _local(world, Tiered(gpu_slots=s)), " of all ranks")

    def _every_token_keys(self, lengths: list[int]):
        """Index keys as SGLang keeps them under DCP: every token of the batch on every rank (its
        index buffer spans the DCP group's whole ``loc`` space), GPU only."""
        return Pool(self.index_config(Tiered(gpu_slots=max(1, sum(lengths)))))

    def sglang_dcp(self, stream: int, n: int) -> _Fit:
        """SGLang's DCP (``--dcp-size world``): the latent rows striped over the ranks, GPU only, and
        the index keys of every token on every rank."""
        if self.sc.mode == "DP":
            return self.gpu_only(stream, n)
        world = self.sc.world
        keys = self._every_token_keys(self.lengths(stream, n))
        return self._rows_only(stream, n, lambda s: _local(world, Tiered(gpu_slots=s)), " of all ranks", keys)

    def sglang_dcp_ulakv(self, stream: int, n: int) -> _Fit:
        """What the SGLang DCP adapter builds (``SGLangDcpStore``): SGLang's DCP with ulakv's local
        mode under the latent rows (a GPU cache and an exclusive CPU tier a rank), the index keys
        left as SGLang keeps them (every token on every rank)."""
        if self.sc.mode == "DP":
            return self._tiered(stream, n)
        return self._striped(stream, n, local=True, index=self._every_token_keys(self.lengths(stream, n)))

    def _rows_only(
        self, stream: int, n: int, layout_of: Callable[[int], object], where: str, keys: object = None
    ) -> _Fit:
        """A GPU-only baseline: latent and index-key pools of ``layout_of(slots)`` with the most
        slots the budget buys, charged for their rows only. ``keys``: an index-key pool of its own
        instead (SGLang's DCP: every token's keys on every rank), the latent taking what it leaves."""

        def build(slots: int) -> tuple[object, object, object]:
            layout = layout_of(slots)
            index = keys if keys is not None else Pool(self.index_config(layout))
            return layout, Pool(self.latent_config(layout)), index

        def charged(latent, index) -> MemoryReport:  # the baseline's rows only, which flatters it
            index_rows = pool_bytes(index, index=True).gpu_index
            return MemoryReport(gpu_rows=pool_bytes(latent).gpu_rows, gpu_index=index_rows)

        slots = _fit_slots(build, self.sc.kv_budget(), lambda built: charged(*built[1:]).gpu)
        if slots < 1:
            why = (
                "weights leave no KV memory"
                if keys is None
                else "GPU memory (the index keys of every token on every rank)"
            )
            return _Fit(False, MemoryReport(), [], why)
        layout, latent, index = build(slots)
        if keys is None:
            pools, limit = [f"latent: {layout}", "index keys: the same slots"], f"GPU KV memory{where}"
        else:
            slots_held = index.config.layout.gpu_slots
            pools = [f"latent: {layout}", f"index keys: every token on every rank, {slots_held} slots"]
            limit = f"GPU KV memory{where} (index keys on every rank)"
        ok = _admits([latent, index], self.lengths(stream, n))
        return _Fit(ok, charged(latent, index), pools, limit, layout)

    def cpu_offload(self, stream: int, n: int) -> _Fit:

        sc = self.sc
        if self.union > sc.slots_per_request:
            return _Fit(False, MemoryReport(), [], f"a step selects {self.union} entries, above the quota")
        history = sc.hardware.cpu_bytes // self.latent_row - 1  # one spare zero row
        lay = CPUOffloadBaseline(cpu_slots=history, slots_per_request=sc.slots_per_request, max_requests=n)
        latent = Pool(self.latent_config(lay))
        lengths = self.lengths(stream, n)
        index_slots = sum(lengths)
        index = Pool(self.index_config(Tiered(gpu_slots=index_slots)))
        b = pool_bytes(latent) + pool_bytes(index, index=True)
        charged = MemoryReport(gpu_buffers=b.gpu_buffers, gpu_index=b.gpu_index, cpu_rows=b.cpu_rows)
        pools = [f"latent: {lay}", f"index keys: GPU only, {index_slots} slots"]
        if charged.gpu > sc.kv_budget():
            return _Fit(False, charged, pools, "GPU memory (per-request buffers and index keys)", lay)
        return _Fit(_admits([latent, index], lengths), charged, pools, "CPU memory (full history)", lay)

    def ulakv(self, stream: int, n: int) -> _Fit:
        return self._striped(stream, n) if self.sc.mode == "TP" else self._tiered(stream, n)

    def ulakv_local(self, stream: int, n: int) -> _Fit:
        return self._striped(stream, n, local=True) if self.sc.mode == "TP" else self._tiered(stream, n)

    def _tiered(self, stream: int, n: int) -> _Fit:

        lengths = self.lengths(stream, n)
        working = n * self.union  # distinct entries one group-step brings to the GPU
        index = Pool(self.index_config(Tiered(gpu_slots=max(1, sum(lengths)))))
        return self._fit_ulakv(n, lengths, index, staging=working, need=working, wrap=lambda t: t)

    def _striped(self, stream: int, n: int, local: bool = False, index: object = None) -> _Fit:
        """ulakv under TP: each rank the slice of its homes. Fetch mode adds a buffer of one step's
        union on every rank; local mode (decode context parallelism) attends where the entries
        live, so a rank's GPU needs only its home share, and keeps no buffer. ``index``: an
        index-key pool of its own instead of keys striped alike (SGLang's DCP keeps every token's
        keys on every rank)."""

        world = self.sc.world
        lengths = self.lengths(stream, n)
        working = n * self.union
        per_home = math.ceil(working * self.shape.home_share)  # what one slice brings in a step
        # Each request's run of addresses puts at most ceil(length / world) on one rank.
        index_inner = Tiered(gpu_slots=max(1, sum(-(-x // world) for x in lengths)))
        if local:
            index_layout = _local(world, index_inner)
            wrap, what = (lambda inner: _local(world, inner)), "one step's home share"
        else:
            index_layout = Striped(world=world, rank=0, buffer_slots=1, inner=index_inner)
            fetch = dict(world=world, rank=0, buffer_slots=working, policy=self.sc.policy)
            wrap, what = (lambda inner: Striped(**fetch, inner=inner)), "the buffer and one step's share"
        index = index if index is not None else Pool(self.index_config(index_layout))
        return self._fit_ulakv(
            n, lengths, index, staging=per_home, need=per_home, wrap=wrap, what=what, where=" of all ranks"
        )

    def _fit_ulakv(
        self,
        n,
        lengths,
        index,
        *,
        staging: int,
        need: int,
        wrap,
        what: str = "one step's working set",
        where: str = "",
    ) -> _Fit:
        """ulakv's latent pool beside ``index``: a ``Tiered`` slice (``wrap`` makes it a striped
        rank's) with ``staging`` CPU rows taken off the CPU budget and as many GPU slots as the
        rest of the GPU budget buys; feasible if a step's ``need`` (``what``) fits and every
        request is admitted."""

        sc = self.sc
        index_bytes = pool_bytes(index, index=True)
        cpu_rows = sc.hardware.cpu_bytes // self.latent_row - 1 - staging
        if cpu_rows < 1:
            return _Fit(False, index_bytes, [], "CPU memory (staging rows)")

        def build(gpu_slots: int):
            inner = Tiered(gpu_slots=gpu_slots, cpu_slots=cpu_rows, policy=sc.policy, staging_slots=staging)
            pool = Pool(self.latent_config(wrap(inner)))
            _reserve(pool, n * sc.queries * sc.model.topk)
            return pool

        gpu_slots = _fit_slots(build, sc.kv_budget() - index_bytes.gpu, lambda p: pool_bytes(p).gpu)
        if gpu_slots < need:
            return _Fit(False, index_bytes, [], f"GPU memory ({what})")
        latent = build(gpu_slots)
        b = pool_bytes(latent) + index_bytes
        pools = [f"latent: {latent.config.layout}", f"index keys: {index.config.layout}"]
        ok = _admits([latent, index], lengths)
        return _Fit(ok, b, pools, f"GPU + CPU memory{where}", latent.config.layout)

    # -- what each system pays --------------------------------------------------------------------
    def _merge_mb(self, n: int) -> tuple[float, float]:
        """MB a rank receives under decode context parallelism, at a batch of ``n``: per layer,
        the all-gathered queries and the partial outputs + LSE of the other ranks (bf16, every
        head, absorbed MLA: queries of kv_lora + rope dims, outputs of kv_lora dims, one fp32 LSE
        a head); per indexer layer, the other ranks' top-k candidates (int32 id + fp32 score)."""
        m, world = self.sc.model, self.sc.world
        positions = n * self.sc.queries
        per_head = (m.kv_lora_rank + m.qk_rope_dim) * 2 + m.kv_lora_rank * 2 + 4
        attention = (world - 1) / world * positions * m.heads * per_head
        candidates = (world - 1) * positions * m.topk * 8
        return attention / 1e6, candidates / 1e6

    def _striped_pays(self, layout: Striped, n: int, b: MemoryReport) -> str:
        world = layout.world
        attention, candidates = self._merge_mb(n)
        merge = f"top-k merge of the indexer ({candidates:.0f} MB of candidates a rank and indexer layer)"
        tiers = "GPU + CPU tiers, misses cross PCIe" if layout.inner.cpu_slots else "GPU only (no CPU tier)"
        if layout.local:
            return (
                f"{tiers}; each rank attends over its own 1/{world} (no buffer, no rows on the wire); "
                f"per layer an all-gather of queries and of partial outputs + LSE ({attention:.0f} MB a "
                f"rank), and a {merge}"
            )
        wire = (world - 1) * layout.fetch_width * self.sc.layers_per_group * self.sc.model.latent_bytes
        return (
            f"{tiers}; a buffer of {layout.buffer_slots} rows on every rank (copies of recent "
            f"selections, {b.gpu_buffers / GB:.1f} GB) and per group-step one all-gather of "
            f"{layout.fetch_width} rows from every rank ({wire / 1e6:.0f} MB a rank, fixed size); a {merge}"
        )

    def pays(self, system: str, layout, n: int, b: MemoryReport) -> str:
        """What ``system`` pays, in words, at a batch of ``n`` (its bytes ``b``)."""
        sc = self.sc
        base = self.same_as(system)
        if base != system:
            same = self.pays(base, layout, n, b)
            return f"a DCP group of one rank under DP attention: {base}'s pools; {same}"
        if layout is None:
            return "nothing fits"
        if isinstance(layout, Replicated):
            return (
                f"a full copy of every request's KV and index keys on each of {layout.world} ranks "
                f"(distinct / physical slots 1/{layout.world}); GPU only"
            )
        if isinstance(layout, CPUOffloadBaseline):
            where = "every rank the same replica" if sc.mode == "TP" else "each rank its own requests"
            return (
                f"a full CPU copy of every token and per-request GPU buffers of {layout.slots_per_request} "
                f"rows a layer (copies; misses cross PCIe); {where}"
            )
        if isinstance(layout, Striped) and system.startswith("sglang_dcp"):
            return (
                f"{self._striped_pays(layout, n, b)}; the indexer's keys of every token on every rank "
                f"({b.gpu_index / GB:.1f} GB), as SGLang keeps them under DCP"
            )
        if isinstance(layout, Striped):
            return self._striped_pays(layout, n, b)
        tiers = "GPU + CPU tiers (PB-LRU), misses cross PCIe" if layout.cpu_slots else "GPU only"
        return f"each rank its own requests, {tiers}; nothing crosses ranks"

    # -- the search ---------------------------------------------------------------------------------
    def _search(self, system: str) -> tuple[list[int], _Fit, str, int]:
        """Per rank: the largest batch ``system`` admits; rank 0's pools at it, why not one more,
        and the distinct tokens the latent pools of all ranks admit."""
        if system in self._searched:
            return self._searched[system]
        feasible = getattr(self, system)
        per_rank, held, first, why = [], 0, None, ""
        for stream in self.streams():
            tried: dict[int, _Fit] = {}

            def fits(k: int, s: int = stream, tried: dict = tried) -> bool:
                tried[k] = feasible(s, k)
                return tried[k].ok

            n = _largest(fits)
            per_rank.append(n)
            last = tried.get(max(n, 1)) or feasible(stream, max(n, 1))
            if n:  # a striped layout's capacity counts every rank's homes
                held += getattr(last.layout, "capacity", 0)
            if stream == 0:
                first = last
                why = (tried.get(n + 1) or feasible(stream, n + 1)).limit
        self._searched[system] = per_rank, first, why, held
        return self._searched[system]

    def run(self, system: str) -> SystemFit:
        per_rank, first, why, held = self._search(self.same_as(system))
        b = first.bytes if per_rank[0] else MemoryReport()
        pays = self.pays(system, first.layout, per_rank[0], b)
        return SystemFit(system, sum(per_rank), per_rank, b, first.pools, why, held, pays)


BASELINES = ("gpu_only", "cpu_offload", "dcp")
ULAKV_MODES = ("ulakv", "ulakv_local")
SYSTEMS = BASELINES + ULAKV_MODES
# ``ulakv capacity --systems sglang``: SGLang as it serves DSA models (GPU only, HiSparse, DCP with
# its index keys on every rank) and what its DCP adapter builds (that DCP over ulakv's local mode).
SGLANG_BASELINES = ("gpu_only", "cpu_offload", "sglang_dcp")
SGLANG_ULAKV = ("sglang_dcp_ulakv",)
SGLANG_SYSTEMS = SGLANG_BASELINES + SGLANG_ULAKV


@dataclass
class ScenarioFit:
    scenario: Scenario
    systems: dict[str, SystemFit]
    shape: SelectionShape

    def best(self, among: tuple[str, ...]) -> SystemFit | None:
        """The system of ``among`` (those planned) that admits most; the first on a tie."""
        fits = [self.systems[s] for s in among if s in self.systems]
        return max(fits, key=lambda p: p.admitted, default=None)

    def rows(self, explain: bool = False) -> list[dict]:
        out = []
        for name, fit in self.systems.items():
            row = {
                "gpu": self.scenario.hardware.name,
                "mode": self.scenario.mode,
                "spec": self.scenario.spec,
                "system": name,
                "admitted": fit.admitted,
            }
            if explain:
                row["breakdown"] = {k: round(v, 3) for k, v in fit.breakdown(self.scenario).items()}
                row["distinct_tokens_held"] = fit.held
                row["pools"] = fit.pools
                row["limit"] = fit.limit
                row["pays"] = fit.pays
                row["assumptions"] = [
                    {"what": w, "value": v, "source": s} for w, v, s in self.scenario.assumptions()
                ]
            out.append(row)
        return out


def fit_systems(scenario: Scenario, systems: tuple[str, ...] = SYSTEMS) -> ScenarioFit:
    """Admitted requests of each system in ``scenario``."""
    fitter = _Fitter(scenario)
    scenario = replace(scenario, shape=fitter.shape)
    return ScenarioFit(scenario, {s: fitter.run(s) for s in systems}, fitter.shape)


def published_scenarios(model: str = "glm-5.3", **overrides) -> list[Scenario]:
    """The 8 published configurations: {H200, B300} x {TP, DP} x {speculation on, off}."""
    shapes = {spec: default_selection_shape(spec) for spec in (True, False)}
    return [
        Scenario(MODELS[model], HARDWARE[hw], mode, spec, shape=shapes[spec], **overrides)
        for hw in ("h200", "b300")
        for mode in ("TP", "DP")
        for spec in (True, False)
    ]


def as_dict(p: ScenarioFit) -> dict:
    return {"scenario": asdict(p.scenario), "systems": {k: asdict(v) for k, v in p.systems.items()}}
