"""Capacity planner: how many long requests each system admits on 8 GPUs, counted by real pools.

Every number comes from pools built on the ``meta`` device with real budgets: the planner sizes
each system's pools from the bytes their tensors take (measured on the meta pools, never a formula
of ours that could drift from the code), then admits requests of the published workload until one
does not fit. A system admits a batch of ``N`` only if all three hold:

- the ``N`` requests (full length: input plus every output token) are admitted by its pools;
- its GPU tensors fit the GPU budget and its CPU tensors the CPU budget;
- one decode step's working set fits: the union of the ``N`` requests' selections in a layer group
  (3 query positions with speculative decoding) fits the pool's ``max_selection`` (ulakv: GPU slots
  and staging rows; striped: the buffer, and each home's share; CPU offload: each request's quota).

Systems (per GPU budgets are equal for all three):

==============  =====================================================  ===========================
system          data parallel (each rank its own requests)             tensor parallel (one batch)
==============  =====================================================  ===========================
``gpu_only``    ``Tiered`` GPU only (SGLang)                            ``Replicated(world)``
``cpu_offload`` ``CPUOffloadBaseline`` (HiSparse)                       one ``CPUOffloadBaseline``
                                                                        replica on every rank
``ulakv``       ``Tiered`` GPU + CPU, PB-LRU                            ``Striped`` over ``Tiered``
==============  =====================================================  ===========================

Index keys are always GPU-resident (the indexer scores every past position each step): a
GPU-only pool of their own beside each latent pool, replicated under TP for the baselines and
striped for ulakv. ulakv is charged for every byte of its tensors (mapping tables, policy state,
call scratch); the baselines only for their KV rows, which flatters them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from .config import PBLRU, CPUOffloadBaseline, EntrySpec, PoolConfig, Replicated, Striped, Tiered
from .errors import CapacityError
from .layouts.offload import OffloadPool
from .layouts.striped import StripedPool, fetch_scratch_bytes
from .pool import Pool

GB = 10**9

# -- presets ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPreset:
    """What the planner needs of a model: KV and index-key bytes, layers, attention dimensions
    (DP attention replicates the attention weights), checkpoint size."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    index_heads: int
    index_dim: int
    indexer_every: int  # one indexer per this many layers; the layers it serves share one selection
    topk: int
    weights_bytes: int  # the FP8 checkpoint, MTP layer included
    source: str
    latent_bytes: int = 656  # FP8 latent: 512 fp8 + 4 fp32 scales + 64 bf16 rope
    index_key_bytes: int = 132  # 128 fp8 + one fp32 scale

    def kv_layers(self, spec: bool) -> int:
        """Layers with latent KV: the decoder's, plus the MTP layer's when it drafts."""
        return self.num_layers + int(spec)

    def index_layers(self, spec: bool) -> int:
        return -(-self.num_layers // self.indexer_every) + int(spec)

    def attention_params_per_layer(self) -> int:
        """MLA projections (q_a, q_b, kv_a, kv_b, o) and the indexer's (wq_b, wk, head weights)."""
        h, n = self.hidden, self.heads
        mla = (
            h * self.q_lora_rank
            + self.q_lora_rank * n * (self.qk_nope_dim + self.qk_rope_dim)
            + h * (self.kv_lora_rank + self.qk_rope_dim)
            + self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
            + n * self.v_head_dim * h
        )
        indexer = (
            self.q_lora_rank * self.index_heads * self.index_dim + h * self.index_dim + h * self.index_heads
        )
        return mla + indexer

    def weights(self, spec: bool) -> int:
        """Checkpoint bytes loaded: without speculation the MTP layer (one decoder layer's share,
        ``weights / (layers + 1)``) stays on disk."""
        return self.weights_bytes if spec else self.weights_bytes - self.mtp_bytes

    @property
    def mtp_bytes(self) -> int:
        return self.weights_bytes // (self.num_layers + 1)

    def attention_weights(self, spec: bool) -> int:
        """FP8 attention weights of every layer (1 byte a parameter; scales left out)."""
        return self.attention_params_per_layer() * self.kv_layers(spec)


_GLM5 = dict(
    num_layers=78,
    hidden=6144,
    heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_dim=192,
    qk_rope_dim=64,
    v_head_dim=256,
    index_heads=32,
    index_dim=128,
    topk=2048,
    weights_bytes=715 * GB,
)
MODELS = {
    "glm-5": ModelPreset(
        name="GLM-5",
        indexer_every=1,
        source="GLM-5 config (GlmMoeDsaConfig defaults); 715 GB FP8 checkpoint (docs/design.md, section 7)",
        **_GLM5,
    ),
    "glm-5.3": ModelPreset(
        name="GLM-5.3",
        indexer_every=4,
        source="GLM-5 dimensions with one indexer per 4 MLA layers (docs/design.md, section 7; the published "
        "experiment's model)",
        **_GLM5,
    ),
    "deepseek-v3.2": ModelPreset(
        name="DeepSeek-V3.2",
        num_layers=61,
        hidden=7168,
        heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        index_heads=64,
        index_dim=128,
        indexer_every=1,
        topk=2048,
        weights_bytes=690 * GB,
        source="DeepSeek-V3.2-Exp config (61 layers, 128 heads, index 64 x 128); 685 B parameters in "
        "FP8 with MTP (about 690 GB)",
    ),
}


@dataclass(frozen=True)
class HardwarePreset:
    name: str
    hbm_bytes: int
    cpu_bytes: int  # CPU memory budget per GPU
    source: str


_CPU_SOURCE = "CPU budget: the published setting (128 GB an H200, 192 GB a B300)"
HARDWARE = {
    "h200": HardwarePreset("H200", 141 * GB, 128 * GB, f"H200: 141 GB HBM3e; {_CPU_SOURCE}"),
    "b300": HardwarePreset("B300", 288 * GB, 192 * GB, f"B300: 288 GB HBM3e; {_CPU_SOURCE}"),
}


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
        """(what, value, source) for everything the plan rests on."""
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


@dataclass
class Bytes:
    """Bytes a system holds on one GPU and in its CPU budget, by what they are for."""

    gpu_rows: int = 0  # latent KV homes (or, replicated, this rank's full copy)
    gpu_buffers: int = 0  # working copies: a striped rank's buffer, per-request GPU buffers
    gpu_index: int = 0  # index-key rows
    gpu_meta: int = 0  # mapping tables, policy state, free stacks, call scratch
    cpu_rows: int = 0  # latent homes (or the full history copy) in CPU memory
    cpu_staging: int = 0  # spare CPU rows a swap's victims go to before their slots are reused

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    @property
    def gpu(self) -> int:
        return self.gpu_rows + self.gpu_buffers + self.gpu_index + self.gpu_meta

    @property
    def cpu(self) -> int:
        return self.cpu_rows + self.cpu_staging


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _tiered_bytes(pool) -> Bytes:
    """A tiered pool's (or a replica's) rows, staging rows and everything else it keeps."""
    st, lay = pool._state, pool._storage.layout
    row = st.cpu_data.shape[0] * st.cpu_data.shape[2]  # every layer of one CPU row
    meta = sum(_nbytes(t) for k, t in st.tensors().items() if k not in ("gpu_data", "cpu_data"))
    staging = lay.cpu_staging * row
    return Bytes(
        gpu_rows=_nbytes(st.gpu_data),
        gpu_meta=meta + _scratch_bytes(pool._layout),
        cpu_rows=_nbytes(st.cpu_data) - staging,
        cpu_staging=staging,
    )


def _scratch_bytes(layout) -> int:
    sc = layout._scratch
    return 0 if sc is None else sum(_nbytes(t) for t in sc.tensors().values())


def pool_bytes(pool, index: bool = False) -> Bytes:
    """What ``pool``'s tensors take (a meta pool's are measured without being allocated); an
    index-key pool's rows count as ``gpu_index``."""
    if isinstance(pool, StripedPool):
        b = _tiered_bytes(pool.inner)  # its GPU rows are the first rows of the rank's buffer tensor
        buffer_meta = sum(_nbytes(t) for k, t in pool._buffer.tensors().items() if k != "gpu_data")
        b.gpu_buffers = _nbytes(pool._rows) - b.gpu_rows
        b.gpu_meta += buffer_meta + _scratch_bytes(pool._buffer_layout)
    elif isinstance(pool, OffloadPool):
        meta = sum(_nbytes(t) for s in pool._buffers for k, t in s.state.tensors().items() if k != "gpu_data")
        meta += _nbytes(pool._history_map) + _nbytes(pool._request_of)
        b = Bytes(gpu_buffers=_nbytes(pool._rows), gpu_meta=meta, cpu_rows=_nbytes(pool._history))
    else:
        b = _tiered_bytes(pool)
    if index:  # index keys are scored where they live: all their rows are index rows
        b.gpu_index, b.gpu_rows, b.gpu_buffers = b.gpu_rows + b.gpu_buffers, 0, 0
    return b


def _reserve(pool, elements: int) -> None:
    """Size a pool's call scratch for one step's selection, as a serving loop would."""
    if elements <= 0:
        return
    if isinstance(pool, StripedPool):
        pool.inner.reserve_scratch(elements)
        pool._buffer_layout.reserve(elements)
    else:
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


# -- the three systems --------------------------------------------------------------------------


@dataclass
class SystemPlan:
    """One system in one scenario: requests admitted and what a GPU holds at that batch."""

    system: str
    admitted: int
    per_rank: list[int]
    bytes_per_gpu: Bytes
    pools: list[str]
    limit: str  # what stopped one more request

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


class _Planner:
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

    # Each system: ``feasible(stream, n) -> (ok, bytes, pools, why)`` for a batch of n.
    def gpu_only(self, stream: int, n: int):

        sc = self.sc

        def build(slots: int) -> tuple[object, object, object]:
            # TP: every rank a replica of the whole batch's KV; DP: each rank a GPU-only pool.
            tp = sc.mode == "TP"
            layout = Replicated(world=sc.world, gpu_slots=slots) if tp else Tiered(gpu_slots=slots)
            return layout, Pool(self.latent_config(layout)), Pool(self.index_config(layout))

        def charged(latent, index) -> Bytes:  # the baseline's rows only, which flatters it
            index_rows = pool_bytes(index, index=True).gpu_index
            return Bytes(gpu_rows=pool_bytes(latent).gpu_rows, gpu_index=index_rows)

        slots = _fit_slots(build, sc.kv_budget(), lambda built: charged(*built[1:]).gpu)
        if slots < 1:
            return False, Bytes(), [], "weights leave no KV memory"
        layout, latent, index = build(slots)
        pools = [f"latent: {layout}", "index keys: the same slots"]
        ok = _admits([latent, index], self.lengths(stream, n))
        return ok, charged(latent, index), pools, "GPU KV memory"

    def cpu_offload(self, stream: int, n: int):

        sc = self.sc
        if self.union > sc.slots_per_request:
            return False, Bytes(), [], f"a step selects {self.union} entries, above the quota"
        history = sc.hardware.cpu_bytes // self.latent_row - 1  # one spare zero row
        lay = CPUOffloadBaseline(cpu_slots=history, slots_per_request=sc.slots_per_request, max_requests=n)
        latent = Pool(self.latent_config(lay))
        lengths = self.lengths(stream, n)
        index_slots = sum(lengths)
        index = Pool(self.index_config(Tiered(gpu_slots=index_slots)))
        b = pool_bytes(latent) + pool_bytes(index, index=True)
        charged = Bytes(gpu_buffers=b.gpu_buffers, gpu_index=b.gpu_index, cpu_rows=b.cpu_rows)
        pools = [f"latent: {lay}", f"index keys: GPU only, {index_slots} slots"]
        if charged.gpu > sc.kv_budget():
            return False, charged, pools, "GPU memory (per-request buffers and index keys)"
        return _admits([latent, index], lengths), charged, pools, "CPU memory (full history)"

    def ulakv(self, stream: int, n: int):
        return self._striped(stream, n) if self.sc.mode == "TP" else self._tiered(stream, n)

    def _tiered(self, stream: int, n: int):

        lengths = self.lengths(stream, n)
        working = n * self.union  # distinct entries one group-step brings to the GPU
        index = Pool(self.index_config(Tiered(gpu_slots=max(1, sum(lengths)))))
        return self._fit_ulakv(n, lengths, index, staging=working, need=working, wrap=lambda t: t)

    def _striped(self, stream: int, n: int):

        world = self.sc.world
        lengths = self.lengths(stream, n)
        working = n * self.union
        per_home = math.ceil(working * self.shape.home_share)  # what one slice brings in a step
        # Each request's run of addresses puts at most ceil(length / world) on one rank.
        index_slice = max(1, sum(-(-x // world) for x in lengths))
        index_layout = Striped(world=world, rank=0, buffer_slots=1, inner=Tiered(gpu_slots=index_slice))
        index = Pool(self.index_config(index_layout))

        def wrap(inner: Tiered) -> Striped:
            return Striped(world=world, rank=0, buffer_slots=working, policy=self.sc.policy, inner=inner)

        return self._fit_ulakv(n, lengths, index, staging=per_home, need=per_home, wrap=wrap, striped=True)

    def _fit_ulakv(self, n, lengths, index, *, staging: int, need: int, wrap, striped: bool = False):
        """ulakv's latent pool beside ``index``: a ``Tiered`` slice (``wrap`` makes it a striped
        rank's) with ``staging`` CPU rows taken off the CPU budget and as many GPU slots as the
        rest of the GPU budget buys; feasible if a step's ``need`` fits and every request is
        admitted."""

        sc = self.sc
        index_bytes = pool_bytes(index, index=True)
        cpu_rows = sc.hardware.cpu_bytes // self.latent_row - 1 - staging
        if cpu_rows < 1:
            return False, index_bytes, [], "CPU memory (staging rows)"

        def build(gpu_slots: int):
            inner = Tiered(gpu_slots=gpu_slots, cpu_slots=cpu_rows, policy=sc.policy, staging_slots=staging)
            pool = Pool(self.latent_config(wrap(inner)))
            _reserve(pool, n * sc.queries * sc.model.topk)
            return pool

        # A striped prepare's collective buffers, when every row a home serves missed.
        scratch = fetch_scratch_bytes(build(1).config, need) if striped else 0
        gpu_slots = _fit_slots(build, sc.kv_budget() - index_bytes.gpu - scratch, lambda p: pool_bytes(p).gpu)
        if gpu_slots < need:
            what = "the buffer and one step's share" if striped else "one step's working set"
            return False, index_bytes, [], f"GPU memory ({what})"
        latent = build(gpu_slots)
        b = pool_bytes(latent) + index_bytes
        b.gpu_meta += scratch
        pools = [f"latent: {latent.config.layout}", f"index keys: {index.config.layout}"]
        limit = "GPU + CPU memory of all ranks" if striped else "GPU + CPU memory"
        return _admits([latent, index], lengths), b, pools, limit

    def run(self, system: str) -> SystemPlan:
        feasible = getattr(self, system)
        per_rank, last = [], None
        for stream in self.streams():
            n = _largest(lambda k, s=stream: feasible(s, k)[0])
            per_rank.append(n)
            if stream == 0:
                last = feasible(stream, max(n, 1))
                why = feasible(stream, n + 1)[3]
        _, b, pools, _ = last
        if not per_rank[0]:
            b = Bytes()
        return SystemPlan(system, sum(per_rank), per_rank, b, pools, why)


SYSTEMS = ("gpu_only", "cpu_offload", "ulakv")


@dataclass
class ScenarioPlan:
    scenario: Scenario
    systems: dict[str, SystemPlan]
    shape: SelectionShape

    def rows(self, explain: bool = False) -> list[dict]:
        out = []
        for name, plan in self.systems.items():
            row = {
                "gpu": self.scenario.hardware.name,
                "mode": self.scenario.mode,
                "spec": self.scenario.spec,
                "system": name,
                "admitted": plan.admitted,
            }
            if explain:
                row["breakdown"] = {k: round(v, 3) for k, v in plan.breakdown(self.scenario).items()}
                row["pools"] = plan.pools
                row["limit"] = plan.limit
                row["assumptions"] = [
                    {"what": w, "value": v, "source": s} for w, v, s in self.scenario.assumptions()
                ]
            out.append(row)
        return out


def plan(scenario: Scenario, systems: tuple[str, ...] = SYSTEMS) -> ScenarioPlan:
    """Admitted requests of each system in ``scenario``."""
    planner = _Planner(scenario)
    scenario = replace(scenario, shape=planner.shape)
    return ScenarioPlan(scenario, {s: planner.run(s) for s in systems}, planner.shape)


def published_scenarios(model: str = "glm-5.3", **overrides) -> list[Scenario]:
    """The 8 published configurations: {H200, B300} x {TP, DP} x {speculation on, off}."""
    shapes = {spec: default_selection_shape(spec) for spec in (True, False)}
    return [
        Scenario(MODELS[model], HARDWARE[hw], mode, spec, shape=shapes[spec], **overrides)
        for hw in ("h200", "b300")
        for mode in ("TP", "DP")
        for spec in (True, False)
    ]


def as_dict(p: ScenarioPlan) -> dict:
    return {"scenario": asdict(p.scenario), "systems": {k: asdict(v) for k, v in p.systems.items()}}
