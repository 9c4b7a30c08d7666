"""The ulakv side of the SGLang adapter: one pool whose addresses are SGLang's token slots (``loc``).

SGLang's allocator hands out ``loc`` in ``[1, size_full + page_size)``; ``loc`` 0 is its padding slot
(padded batch entries write there), so here it means padding, like ``-1``. The pool holds every live
``loc`` in exactly one home, a GPU slot of the shared cache or a CPU row; attention reads GPU slots of
``paged_buffer(layer)``, which the KV pool hands SGLang as the layer's ``kv_buffer``.

Plain torch and ulakv: the coordinator, the KV pool and the allocator of
``ulakv.integrations.sglang`` share one store, and the CPU tests drive it through SGLang's own index
transform without importing SGLang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ...config import PBLRU, EntrySpec, ExactLRU, PolicyConfig, PoolConfig, Tiered
from ...engine.adapter import GroupStep, SparseKV
from ...errors import InvalidInputError
from ...layouts.tiered import TieredPool
from ...pool import Pool

#: FlashMLA's page: SGLang's DSA pools keep ``size + page_size`` rows, viewed as 64-row pages.
FLASHMLA_PAGE = 64


def loc_addresses(loc: torch.Tensor) -> torch.Tensor:
    """SGLang's ``loc`` as pool addresses: 0 (SGLang's padding slot) becomes -1; one device op."""
    return torch.where(loc == 0, -1, loc)


@dataclass(frozen=True)
class StoreConfig:
    """How SGLang's HiSparse sizes map onto one ulakv pool (per rank: DP attention runs one each).

    ``device_tokens`` is HiSparse's device pool (``size``): here the GPU cache shared by every
    request. ``logical_tokens`` (``size x host_to_device_ratio``) is how many ``loc`` may be live at
    once; the CPU tier holds those not on the GPU, exclusively (no CPU copy of GPU entries).
    ``page_size`` is SGLang's allocator page (``loc`` space ``[0, logical_tokens + page_size)``).
    """

    layers: int
    bytes_per_token: int
    device_tokens: int
    logical_tokens: int
    page_size: int = 1
    max_batch: int = 256
    max_queries: int = 1
    top_k: int = 2048
    layers_per_group: int = 1
    group_starts: tuple[int, ...] | None = None  # the layers that compute a fresh top-k
    policy: PolicyConfig = field(default_factory=ExactLRU)
    staging_tokens: int | None = None
    device: str | torch.device = "cpu"
    validate: bool | None = None

    def pool_config(self) -> PoolConfig:
        gpu = self.device_tokens
        cpu = max(self.logical_tokens - gpu, 0)
        return PoolConfig(
            entry=EntrySpec(self.bytes_per_token),
            num_layers=self.layers,
            layers_per_group=self.layers_per_group,
            group_starts=self.group_starts,
            layout=Tiered(
                gpu_slots=gpu, cpu_slots=cpu, policy=self.policy, staging_slots=self.staging_tokens
            ),
            device=self.device,
            validate=self.validate,
            engine_addresses=self.logical_tokens + self.page_size,
            page_size=FLASHMLA_PAGE,
        )


def policy_named(name: str) -> PolicyConfig:
    """``ULAKV_SGLANG_POLICY``: ``lru`` (exact LRU, the default) or ``pblru``."""
    policies = {"lru": ExactLRU(), "exact_lru": ExactLRU(), "pblru": PBLRU()}
    if name not in policies:
        raise InvalidInputError(f"ULAKV_SGLANG_POLICY must be one of {sorted(policies)}, got {name!r}")
    return policies[name]


class LocStore:
    """What both stores do alike with SGLang's ``loc`` over their ``pool`` and its ``kv`` adapter
    (``SGLangStore`` for DP attention, ``SGLangDcpStore`` for a DCP rank): ``loc`` 0 is padding;
    live, released and written as the allocator and the KV pool say; rows viewed as SGLang's
    ``kv_buffer``. Pool-wide calls wait for the adapter's side stream first."""

    pool: Pool
    kv: SparseKV

    addresses = staticmethod(loc_addresses)

    def admit(self, loc: torch.Tensor) -> None:
        """New tokens' ``loc`` (a decode step's ``out_cache_loc``, a prefill's extend): live now."""
        if loc.numel():
            self.kv.join()
            self.pool.admit_addresses(self.addresses(loc.reshape(-1)))

    def release(self, loc: torch.Tensor) -> None:
        """``loc`` SGLang's allocator frees (a finished or retracted request's, or a cached prefix
        evicted from the radix tree): a shared prefix is released once, when its last holder lets
        it go."""
        if loc.numel():
            self.kv.join()
            self.pool.release_addresses(self.addresses(loc.reshape(-1)))

    def release_all(self) -> None:
        """Every live ``loc`` (SGLang's ``clear``, at start-up and cache flushes): reads the pool's
        books back, a sync, never on a step."""
        self.kv.join()
        live = self.pool.live_addresses()
        if live.numel():
            self.pool.release_addresses(live)

    def write(self, layer: int, loc: torch.Tensor, rows: torch.Tensor) -> None:
        """One layer's rows (uint8 ``[n, bytes_per_token]``) for ``loc`` (0 / -1: padding rows); a
        DCP rank keeps those homed on it."""
        self.kv.write(layer, self.addresses(loc.reshape(-1)), rows)

    def kv_rows(self, layer: int) -> torch.Tensor:
        """uint8 ``[rows, 1, bytes_per_token]``: the layer's GPU rows as SGLang's ``kv_buffer`` (whole
        64-row pages; row ``gpu_slots`` the dummy)."""
        paged = self.pool.paged_buffer(layer)
        return paged.view(-1, 1, paged.shape[-1])


class SGLangStore(LocStore):
    """One ulakv pool bound to SGLang's conventions: ``loc`` addresses (0 = padding), per-layer
    ``swap in`` of top-k selections through :class:`SparseKV`, rows written as bytes."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.pool: TieredPool = Pool(config.pool_config())
        self.kv = SparseKV(
            self.pool, max_batch=config.max_batch, top_k=config.top_k, max_queries=config.max_queries
        )
        self._steps: dict[int, GroupStep] = {}  # group -> its step of the current forward

    def bound(self, max_queries: int, top_k: int) -> None:
        """Size the per-step buffers for ``[max_batch, max_queries, top_k]`` selections (the
        coordinator knows SGLang's draft tokens and the model's top-k; the KV pool, built first, does
        not). Rebuilds the adapter only when they grow, before any step."""
        if max_queries <= self.kv.max_queries and top_k <= self.kv.top_k:
            return
        self.kv.join()
        self.config = dataclasses.replace(
            self.config, max_queries=max(max_queries, self.kv.max_queries), top_k=max(top_k, self.kv.top_k)
        )
        self.kv = SparseKV(
            self.pool,
            max_batch=self.config.max_batch,
            top_k=self.config.top_k,
            max_queries=self.config.max_queries,
        )
        self._steps.clear()

    def slots(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """int32 slots of ``paged_buffer(layer)`` for ``loc`` (``[B, K]`` or ``[B, Q, K]``; -1 or 0:
        padding, -1 out). The first layer of a layer group prepares the group; the group's other
        layers wait for their rows and reuse its slots (SGLang's shared-index layers)."""
        group = self.pool.config.group_of(layer)
        layers = self.pool.config.group_layers(group)
        if layer == layers.start or group not in self._steps:
            self._steps[group] = self.kv.prepare(group, self.addresses(loc))
        return self._steps[group].wait(layer)

    def prefill_slots(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """Slots for a prefill's ``[tokens, K]`` selection of ``loc``: one prepare of the whole
        selection (its own scratch, any number of tokens). Raises ``CapacityError``, changing
        nothing, when the prompt's queries together select more distinct slots than one prepare may
        (``max_selection``): SGLang attends over a whole extend at once, so lower
        ``--chunked-prefill-size`` until each chunk fits (``ulakv.engine.chunked_prepare`` splits
        one for an engine that attends chunk by chunk)."""
        group = self.pool.config.group_of(layer)
        self.kv.join()
        slots = self.pool.prepare(group, self.addresses(loc)).slots
        self.pool.check()  # prefill is not captured: a refusal is raised now, not a step later
        return slots
