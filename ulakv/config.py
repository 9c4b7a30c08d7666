"""Declarative pool configuration: frozen dataclasses validated at construction.

A pool is described, not assembled: ``PoolConfig(entry, num_layers, layers_per_group, layout, device)``.
Every check happens here so that a bad configuration fails before any memory is allocated.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from .errors import ConfigError

# Mapping values are int32 and encode a GPU slot as itself and a CPU slot as gpu_slots + slot, so the
# two tiers together must stay below 2**31 (about 2.1 G slots: far above 141 GB / 656 B ≈ 215 M).
MAX_SLOTS = 2**31 - 2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class EntrySpec:
    """What one token stores in one layer: an opaque row of ``bytes_per_layer`` bytes.

    656 bytes for GLM-5 / DeepSeek-V3.2 FP8 latent KV (512 fp8 + 4 fp32 scales + 64 bf16 rope),
    1152 for bf16 576-dim latent KV. Rows move as bytes, so every dtype moves bit-exactly.
    """

    bytes_per_layer: int

    def __post_init__(self) -> None:
        _check_int("EntrySpec.bytes_per_layer", self.bytes_per_layer, 1)


@dataclass(frozen=True)
class ExactLRU:
    """Exact least-recently-used eviction: victims are the slots whose last use is oldest.

    Slots touched in the same round are ordered by their first position in that round's selection.
    """

    name = "exact_lru"


@dataclass(frozen=True)
class PBLRU:
    """Parallel bucketed LRU: a ring of ``num_buckets`` per-round bucket bitmaps (the current round
    and the ones before it) plus one cold bitmap, each with summary levels for a search that skips
    empty segments. Victims: free slots, then cold, then the ring oldest first; never the current
    round. Within a bucket, lower slots go first."""

    num_buckets: int = 8
    name = "pblru"

    def __post_init__(self) -> None:
        _check_int("PBLRU.num_buckets", self.num_buckets, 2)
        if self.num_buckets > 1024:
            raise ConfigError(f"PBLRU.num_buckets must be <= 1024, got {self.num_buckets}")


PolicyConfig = ExactLRU | PBLRU


@dataclass(frozen=True)
class Tiered:
    """Exclusive two-tier layout: every entry lives on the GPU or on the CPU, never both.

    One GPU pool of ``gpu_slots`` is shared by all requests; ``cpu_slots`` of pinned host memory hold
    the rest. ``cpu_slots=0`` is a GPU-only pool. Admission capacity is ``gpu_slots + cpu_slots``.

    ``staging_slots`` more CPU rows (not admitted into) let a swap copy each evicted entry to a free
    row before its GPU slot is overwritten, so an interrupted transfer leaves every entry readable at
    its old home. A ``prepare`` may select at most ``max_selection`` distinct addresses per group.
    Default: ``gpu_slots`` (any selection that fits the GPU); 0 when there is no CPU tier, since a
    GPU-only pool never evicts.

    ``write_copies`` (default on): a row written while a plain free CPU row exists also gets a clean
    copy there, so that its eviction moves nothing (the copy is free space, dropped when the tier
    needs the row); off, written rows get no copy until they are evicted (the behaviour before,
    kept to measure against).
    """

    gpu_slots: int
    cpu_slots: int = 0
    policy: PolicyConfig = field(default_factory=ExactLRU)
    staging_slots: int | None = None
    write_copies: bool = True

    def __post_init__(self) -> None:
        _check_int("Tiered.gpu_slots", self.gpu_slots, 1)
        _check_int("Tiered.cpu_slots", self.cpu_slots, 0)
        if self.staging_slots is not None:
            _check_int("Tiered.staging_slots", self.staging_slots, 1 if self.cpu_slots else 0)
        if not isinstance(self.write_copies, bool):
            raise ConfigError(f"Tiered.write_copies must be a bool, got {self.write_copies!r}")
        if self.cpu_slots == 0 and self.staging_slots:
            raise ConfigError("Tiered.staging_slots needs a CPU tier (cpu_slots > 0): nothing is evicted")
        total = self.gpu_slots + self.cpu_slots + self.cpu_staging
        if total > MAX_SLOTS:
            raise ConfigError(
                f"gpu_slots + cpu_slots + staging_slots = {total} exceeds {MAX_SLOTS}: "
                "mapping entries are int32"
            )
        if not isinstance(self.policy, (ExactLRU, PBLRU)):
            raise ConfigError(
                f"Tiered.policy must be a policy config such as ExactLRU(), got {self.policy!r}"
            )

    @property
    def capacity(self) -> int:
        """Logical addresses the layout can hold at once (one home each)."""
        return self.gpu_slots + self.cpu_slots

    @property
    def cpu_staging(self) -> int:
        """Staging rows actually allocated on the CPU (``staging_slots`` resolved)."""
        if self.cpu_slots == 0:
            return 0
        return self.gpu_slots if self.staging_slots is None else self.staging_slots

    @property
    def max_selection(self) -> int:
        """Most distinct addresses one ``prepare`` may select in a group."""
        if self.cpu_slots == 0:
            return self.gpu_slots
        return min(self.gpu_slots, self.cpu_staging)


ATTENTION_MODES = ("fetch", "local")


@dataclass(frozen=True)
class Striped:
    """Tensor-parallel layout: logical address ``t`` has its one home on rank ``t mod world``.

    Every rank of a ``torch.distributed`` group builds the same config with its own ``rank``;
    ``inner`` (a ``Tiered``) is this rank's slice of history: GPU only, or with a CPU tier.
    Admission capacity is ``world x inner.capacity``. ``attention`` says where each rank attends:

    - ``"fetch"``: every rank attends over the whole selection. ``buffer_slots`` GPU rows on every
      rank hold copies of recently selected entries (``policy`` decides which); misses are fetched
      from their homes by one all-gather of ``fetch_rows`` rows from every rank (a fixed size, so a
      step can be captured; default: the most one home may hold of a selection). A ``prepare`` may
      select at most ``buffer_slots`` distinct addresses a group, at most ``inner.max_selection`` of
      them homed on one rank and at most ``fetch_rows`` of those missing the buffer.
    - ``"local"``: decode context parallelism. Each rank makes resident only the selected entries
      homed on it and returns -1 for the others; the engine attends over its part and merges the
      ranks' partial outputs by their log-sum-exp. No buffer (``buffer_slots`` stays 0), no
      collective in ``prepare``. A ``prepare`` may select at most ``inner.max_selection``
      distinct addresses homed on any one rank.
    """

    world: int
    rank: int
    buffer_slots: int = 0
    policy: PolicyConfig = field(default_factory=ExactLRU)
    inner: Tiered = field(default_factory=lambda: Tiered(gpu_slots=1))
    timeout_s: float = 60.0  # a collective that takes longer raises CollectiveError on this rank
    attention: str = "fetch"
    fetch_rows: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or self.timeout_s <= 0
        ):
            raise ConfigError(
                f"Striped.timeout_s must be a positive number of seconds, got {self.timeout_s!r}"
            )
        _check_int("Striped.world", self.world, 1)
        _check_int("Striped.rank", self.rank, 0)
        if self.rank >= self.world:
            raise ConfigError(f"Striped.rank must be < world ({self.world}), got {self.rank}")
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"Striped.attention must be one of {ATTENTION_MODES}, got {self.attention!r}")
        if self.attention == "fetch":
            _check_int("Striped.buffer_slots", self.buffer_slots, 1)
            if self.fetch_rows is not None:
                _check_int("Striped.fetch_rows", self.fetch_rows, 1)
        elif self.buffer_slots != 0 or self.fetch_rows is not None:
            raise ConfigError(
                'Striped(attention="local") keeps no buffer and fetches nothing: leave buffer_slots '
                f"and fetch_rows unset (got {self.buffer_slots}, {self.fetch_rows})"
            )
        if not isinstance(self.policy, (ExactLRU, PBLRU)):
            raise ConfigError(
                f"Striped.policy must be a policy config such as ExactLRU(), got {self.policy!r}"
            )
        if not isinstance(self.inner, Tiered):
            raise ConfigError(f"Striped.inner must be a Tiered layout, got {self.inner!r}")
        if self.inner.gpu_slots + self.buffer_slots + 2 > MAX_SLOTS:  # slots into gpu_buffer are int32
            raise ConfigError(
                f"inner.gpu_slots + buffer_slots = {self.inner.gpu_slots + self.buffer_slots} is too large"
            )
        if self.world * self.inner.capacity > MAX_SLOTS:
            raise ConfigError(
                f"world x inner capacity = {self.world * self.inner.capacity} exceeds {MAX_SLOTS}"
            )

    @property
    def local(self) -> bool:
        """Decode context parallelism: each rank attends over the entries homed on it."""
        return self.attention == "local"

    @property
    def capacity(self) -> int:
        """Logical addresses all ranks hold together (each on its home rank only)."""
        return self.world * self.inner.capacity

    @property
    def per_home_selection(self) -> int:
        """Most distinct addresses homed on one rank a ``prepare`` may select: its slice brings
        them to its GPU."""
        return self.inner.max_selection

    @property
    def fetch_width(self) -> int:
        """Rows every rank contributes to a fetch-mode prepare's all-gather, padding included: the
        most misses homed on one rank a prepare may have (0 in local mode)."""
        if self.local:
            return 0
        most = min(self.buffer_slots, self.per_home_selection)
        return most if self.fetch_rows is None else min(self.fetch_rows, most)

    @property
    def max_selection(self) -> int:
        """Most distinct addresses a ``prepare`` may select in a group. Fetch: every one passes
        through the buffer. Local: each home's share passes through its slice. Every rank checks
        the limits, and those per home, before anything changes."""
        if self.local:
            return self.world * self.per_home_selection
        return self.buffer_slots


@dataclass(frozen=True)
class Replicated:
    """Today's MLA under tensor parallelism, kept as an honest baseline: each of ``world`` ranks
    stores every entry in its own ``gpu_slots`` GPU rows (the latent KV cannot be split by head).

    A pool built from it is one rank's replica (every rank receives the same calls and rows, so
    the replicas stay equal without communication). Admission capacity is ``gpu_slots``, not
    ``world x gpu_slots``; ``stats()["physical_slots_used"]`` counts the slots of all ``world``
    replicas, so distinct entries / physical slots is ``1 / world`` (``gpu_slots_used``: this
    replica's).
    """

    world: int
    gpu_slots: int

    def __post_init__(self) -> None:
        _check_int("Replicated.world", self.world, 1)
        _check_int("Replicated.gpu_slots", self.gpu_slots, 1)
        if self.gpu_slots > MAX_SLOTS:
            raise ConfigError(f"Replicated.gpu_slots exceeds {MAX_SLOTS}: mapping entries are int32")

    @property
    def storage(self) -> Tiered:
        """What one replica is: a GPU-only tiered pool (it never evicts)."""
        return Tiered(gpu_slots=self.gpu_slots, cpu_slots=0)

    @property
    def capacity(self) -> int:
        return self.gpu_slots

    @property
    def max_selection(self) -> int:
        return self.gpu_slots


@dataclass(frozen=True)
class CPUOffloadBaseline:
    """The CPU-offload baseline (SGLang's HiSparse), kept as an honest comparison: the full history
    in ``cpu_slots`` CPU rows (every admitted token has one), and each of at most ``max_requests``
    requests a fixed GPU buffer of ``slots_per_request`` rows a layer group with its own exact
    LRU. GPU rows are copies: a miss copies the row in from the CPU, a victim is dropped, a write
    goes to the CPU history at once and its token into the request's buffer as the most recent
    entry (the last ``slots_per_request`` of a prefill).

    Admission capacity is ``cpu_slots`` tokens and ``max_requests`` requests; a ``prepare`` may
    select at most ``slots_per_request`` distinct addresses of one request in a group.
    """

    cpu_slots: int
    slots_per_request: int = 4096
    max_requests: int = 1

    def __post_init__(self) -> None:
        _check_int("CPUOffloadBaseline.cpu_slots", self.cpu_slots, 1)
        _check_int("CPUOffloadBaseline.slots_per_request", self.slots_per_request, 1)
        _check_int("CPUOffloadBaseline.max_requests", self.max_requests, 1)
        if self.cpu_slots > MAX_SLOTS:
            raise ConfigError(f"CPUOffloadBaseline.cpu_slots exceeds {MAX_SLOTS}: addresses are int32")
        if self.max_requests * (self.slots_per_request + 1) + 1 > MAX_SLOTS:
            raise ConfigError("max_requests x slots_per_request is too large: slots are int32")

    @property
    def capacity(self) -> int:
        return self.cpu_slots

    @property
    def max_selection(self) -> int:
        """Most distinct addresses of one request a ``prepare`` may select in a group."""
        return self.slots_per_request

    @property
    def gpu_slots(self) -> int:
        """GPU rows a layer of the pool holds: every request's buffer."""
        return self.max_requests * self.slots_per_request


LayoutConfig = Tiered | Striped | Replicated | CPUOffloadBaseline


@dataclass(frozen=True)
class PoolConfig:
    """A whole pool: what an entry is, how many layers share a selection, where entries live.

    ``layers_per_group`` consecutive layers share one top-k selection and one residency;
    when it does not divide ``num_layers`` the last group is shorter (78 = 19 x 4 + 2).
    ``group_starts`` says the groups one by one instead, as a model's configuration does: the first
    layer of each group, ascending from 0 (a model computes a fresh top-k at these layers and reuses
    it in the layers up to the next; GLM-5.3: 21 groups of 78 layers, the first two of one layer,
    then nineteen of four: ``ulakv.integrations.sglang.layer_groups``).
    ``layers_per_group`` stays 1 when it is given.
    ``validate`` decides whether ``prepare``/``write`` read back a status word to raise on bad
    addresses at once (one device sync); ``None`` means yes on CPU, where reading it costs no sync,
    and no on CUDA, where errors are recorded on the device and raised by the next synchronising call
    (``stats``, ``read``, ``check``). ``ULAKV_DEBUG=1`` forces validation and invariant checks.

    ``engine_addresses`` hands the logical addresses to the engine (SGLang's token ``loc``, vLLM's slot
    ids): addresses are the ints ``[0, engine_addresses)``, which the engine makes live with
    ``admit_addresses`` and gives back with ``release_addresses`` (at most ``layout.capacity`` live at
    once), and the pool's own ``admit``/``extend``/``release`` are refused. ``None`` (the default):
    the pool hands out addresses itself. Tiered and Replicated layouts, and ``Striped(attention=
    "local")``: one address space over the ranks, address ``a`` homed on rank ``a % world`` at local
    address ``a // world`` (SGLang's decode context parallelism keeps token slot ``s`` the same way),
    each rank's tier large enough for its share (``inner.capacity >= ceil(engine_addresses / world)``).

    ``page_size`` rounds each layer's GPU rows (the slots and the dummy row) up to a multiple of it,
    so ``paged_buffer(layer)`` views them as a paged KV cache ``[pages, page_size, 1, bytes]`` with no
    copy (FlashMLA's sparse kernels: 64). The extra rows are never handed out. Tiered and Replicated
    layouts, and ``Striped(attention="local")`` (a rank's slice: SGLang's DCP reads it as pages).
    """

    entry: EntrySpec
    num_layers: int
    layout: LayoutConfig
    layers_per_group: int = 1
    device: str | torch.device = "cpu"
    validate: bool | None = None
    engine_addresses: int | None = None
    page_size: int = 1
    group_starts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.entry, EntrySpec):
            raise ConfigError(f"PoolConfig.entry must be an EntrySpec, got {self.entry!r}")
        _check_int("PoolConfig.num_layers", self.num_layers, 1)
        _check_int("PoolConfig.layers_per_group", self.layers_per_group, 1)
        if self.layers_per_group > self.num_layers:
            raise ConfigError(
                f"layers_per_group ({self.layers_per_group}) exceeds num_layers ({self.num_layers})"
            )
        if self.group_starts is not None:
            self._check_group_starts()
        if not isinstance(self.layout, (Tiered, Striped, Replicated, CPUOffloadBaseline)):
            raise ConfigError(
                f"PoolConfig.layout must be a layout config such as Tiered(...), got {self.layout!r}"
            )
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"PoolConfig.device {self.device!r} is not a torch device") from exc
        if device.type not in ("cpu", "cuda", "meta"):
            raise ConfigError(f"PoolConfig.device must be cpu, cuda or meta, got {device}")
        if self.validate is not None and not isinstance(self.validate, bool):
            raise ConfigError(f"PoolConfig.validate must be None or a bool, got {self.validate!r}")
        _check_int("PoolConfig.page_size", self.page_size, 1)
        local = isinstance(self.layout, Striped) and self.layout.local
        if self.page_size > 1 and not isinstance(self.layout, (Tiered, Replicated)) and not local:
            raise ConfigError(
                'PoolConfig.page_size needs a Tiered or Replicated layout or Striped(attention="local"), '
                f"got {type(self.layout).__name__}"
            )
        if self.engine_addresses is not None:
            _check_int("PoolConfig.engine_addresses", self.engine_addresses, 1)
            local = isinstance(self.layout, Striped) and self.layout.local
            if not isinstance(self.layout, (Tiered, Replicated)) and not local:
                raise ConfigError(
                    "PoolConfig.engine_addresses needs a Tiered or Replicated layout (an engine-owned "
                    'address space per rank) or Striped(attention="local") (one space over the ranks), '
                    f"got {type(self.layout).__name__}"
                    + (' (attention="fetch")' if isinstance(self.layout, Striped) else "")
                )
            if local and self.layout.inner.capacity < -(-self.engine_addresses // self.layout.world):
                # Every rank decides every refusal alike from the same books; a rank that could run
                # out of homes before the engine runs out of addresses would refuse alone.
                raise ConfigError(
                    f"Striped with engine_addresses={self.engine_addresses} over {self.layout.world} "
                    f"ranks homes up to {-(-self.engine_addresses // self.layout.world)} addresses a "
                    f"rank, more than inner.capacity = {self.layout.inner.capacity} (gpu_slots + "
                    "cpu_slots): size each rank's tier for its share of the engine's addresses"
                )
            if self.engine_addresses >= 2**31:
                raise ConfigError(
                    "PoolConfig.engine_addresses must be < 2**31 (int32 positions), "
                    f"got {self.engine_addresses}"
                )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def _check_group_starts(self) -> None:
        starts = self.group_starts
        if not isinstance(starts, tuple) or not starts or not all(_is_int(s) for s in starts):
            raise ConfigError(f"PoolConfig.group_starts must be a non-empty tuple of ints, got {starts!r}")
        if starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ConfigError(f"PoolConfig.group_starts must ascend strictly from 0, got {starts!r}")
        if starts[-1] >= self.num_layers:
            raise ConfigError(
                f"PoolConfig.group_starts: a group starts at layer {starts[-1]}, past the "
                f"{self.num_layers} layers"
            )
        if self.layers_per_group != 1:
            raise ConfigError("PoolConfig: give layers_per_group or group_starts, not both")

    @property
    def num_groups(self) -> int:
        if self.group_starts is not None:
            return len(self.group_starts)
        return -(-self.num_layers // self.layers_per_group)

    def group_layers(self, group: int) -> range:
        """The layers of ``group`` (the last group may be shorter)."""
        if self.group_starts is not None:
            starts = self.group_starts
            return range(starts[group], starts[group + 1] if group + 1 < len(starts) else self.num_layers)
        start = group * self.layers_per_group
        return range(start, min(start + self.layers_per_group, self.num_layers))

    def group_of(self, layer: int) -> int:
        if self.group_starts is not None:
            return bisect.bisect_right(self.group_starts, layer) - 1
        return layer // self.layers_per_group

    @property
    def max_group_layers(self) -> int:
        """Layers of the largest group (what a row of a whole group spans)."""
        if self.group_starts is not None:
            return max(len(self.group_layers(g)) for g in range(self.num_groups))
        return min(self.layers_per_group, self.num_layers)

    def replace(self, **changes: object) -> PoolConfig:
        return dataclasses.replace(self, **changes)
