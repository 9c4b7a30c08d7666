"""What every kind of pool shares: its shape, the checks of its arguments, what ``prepare``
returns, and the debug switch.

A tiered or replicated pool (``ulakv.layouts.tiered``), a striped rank (``ulakv.layouts.striped``)
and the CPU-offload baseline (``ulakv.layouts.offload``) keep ``config``, ``device``, ``_allocator``,
``_id`` and ``_debug``; each refuses a bad group, layer, device or sequence with the same words, and
each runs ``_after_call`` after every call that changes it.
"""

from __future__ import annotations

import abc
import inspect
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .address_space import LogicalAllocator, Sequence
from .config import PoolConfig
from .errors import CapacityError, InvalidAddressError, InvalidInputError, UlakvError
from .kernels import common as K


def debug_enabled() -> bool:
    """``ULAKV_DEBUG=1``: validate every call and check every invariant after it (host syncs by
    design). Read here only, once per pool, when it is built."""
    return os.environ.get("ULAKV_DEBUG", "0") not in ("", "0")


def validates(config: PoolConfig, debug: bool) -> bool:
    """Whether a pool reads each call's status back and raises at once (``PoolConfig.validate``;
    ``ULAKV_DEBUG=1`` forces it)."""
    if config.validate is not None and not debug:
        return config.validate
    return debug or config.torch_device.type == "cpu"


def refusal(
    what: str, status: int, *, bad_address: str, too_large: str, full: str = "", home_limit: str = ""
) -> UlakvError:
    """The error a refused call's status word stands for (the ``ST_*`` bits of
    ``kernels/common.py``), by the first bit set of: a bad address, a duplicate in a write, more
    addresses live than the pool holds, a selection over the pool's bound, one over a home's share
    (a striped pool). Each pool kind says what its limits are (``bad_address`` and the others:
    the words after ``what:``); every message ends by saying nothing changed. (A prepare's new row
    whose address is not new is refused after a bad address and a duplicate.)"""
    if status & int(K.ST_BAD_ADDRESS):
        return InvalidAddressError(f"{what}: {bad_address}; nothing changed")
    if status & int(K.ST_DUPLICATE):
        return InvalidAddressError(f"{what}: an address appears more than once; nothing changed")
    if status & int(K.ST_NOT_NEW):
        return InvalidAddressError(
            f"{what}: a new row's address already has a home or appears twice among the new rows "
            "(write it with write()); nothing changed"
        )
    for bit, words in ((K.ST_FULL, full), (K.ST_TOO_LARGE, too_large), (K.ST_HOME_LIMIT, home_limit)):
        if status & int(bit) and words:
            return CapacityError(f"{what}: {words}; nothing changed")
    return UlakvError(f"{what}: failed with status {status}; nothing changed")


@dataclass(frozen=True)
class NewRows:
    """New tokens' rows handed to ``prepare`` (``prepare(group, topk, new=NewRows(...))``): layer
    ``layer`` (of the prepared group) of the addresses ``addresses`` (int32/int64 ``[n]``, ``-1``
    padding, none homed yet) is ``rows`` (uint8 ``[n, bytes_per_layer]``, any view). One plan
    decides their homes and the selection's misses together: the write and the prepare of a
    layer in one call, with the same guarantees as the two. The new tokens count toward the
    prepare's ``max_selection`` (all are on the GPU once it has run)."""

    layer: int
    addresses: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class Selection:
    """What ``prepare`` returns: int32 GPU slots in the selection's shape (-1 where padding)."""

    group: int
    slots: torch.Tensor


@dataclass
class MemoryReport:
    """What a pool's tensors take, in bytes, by what they are for (``PoolFrame.memory``; a ``meta``
    pool's are measured without being allocated). ``ulakv capacity`` adds these up per system."""

    gpu_rows: int = 0  # latent KV homes (or, replicated, this rank's full copy)
    gpu_buffers: int = 0  # working copies: a striped rank's buffer, per-request GPU buffers
    gpu_index: int = 0  # index-key rows (an index-key pool's rows, as ``ulakv capacity`` counts them)
    gpu_meta: int = 0  # mapping tables, policy state, free stacks, call scratch
    cpu_rows: int = 0  # homes (or the full history copy) in CPU memory
    cpu_staging: int = 0  # spare CPU rows a swap's victims go to before their slots are reused

    def __add__(self, other: MemoryReport) -> MemoryReport:
        return MemoryReport(**{k: v + getattr(other, k) for k, v in self.__dict__.items()})

    @property
    def gpu(self) -> int:
        return self.gpu_rows + self.gpu_buffers + self.gpu_index + self.gpu_meta

    @property
    def cpu(self) -> int:
        return self.cpu_rows + self.cpu_staging


class Internals:
    """The testing hook (``pool.internals()``): an object's private attributes without their
    underscore, read and set through (``pool.internals().state`` is the pool's state). For tests and
    tools that check a pool's state or inject a fault into it; not for serving: what is there
    changes with the implementation. Nothing in the package reads another module's private
    attributes (``tests/test_design_doc.py``); the tests do it through this hook only."""

    def __init__(self, owner: object) -> None:
        object.__setattr__(self, "owner", owner)

    def __getattr__(self, name: str) -> object:
        owner = object.__getattribute__(self, "owner")
        try:
            return getattr(owner, "_" + name)
        except AttributeError:
            raise AttributeError(f"{type(owner).__name__} keeps no {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        owner = object.__getattribute__(self, "owner")
        if not hasattr(owner, "_" + name):
            raise AttributeError(f"{type(owner).__name__} keeps no {name!r}")
        setattr(owner, "_" + name, value)


def nbytes(t: torch.Tensor) -> int:
    """A tensor's bytes (a ``meta`` tensor's too)."""
    return t.numel() * t.element_size()


def same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index == device.index


class PoolFrame(abc.ABC):
    config: PoolConfig
    device: torch.device
    _allocator: LogicalAllocator
    _id: int
    _debug: bool = False

    def internals(self) -> Internals:
        """The testing hook: this pool's private attributes (``Internals``)."""
        return Internals(self)

    # What a pool-wide call waits for first: work in flight on an adapter's streams (order_after).
    _joins: tuple[Callable[[], None], ...] = ()

    def order_after(self, join: Callable[[], None]) -> None:
        """Call ``join`` first in every call that acts on the whole pool or reads its state back
        (``release``, ``admit_addresses``, ``release_addresses``, ``live_addresses``, ``read``,
        ``residency``, ``check``, ``stats``, ``check_invariants``, ``state_dict``). ``SparseKV``
        registers the join of its call contexts' streams: an engine's admit or release then never
        runs beside a prepare still planning or moving rows on a side stream (both write the
        mapping, and the engine's check stamps context 0's claim words). Stream waits, no sync. A
        bound method is held weakly: an adapter dropped and rebuilt over the same pool leaves no
        join behind."""
        held = weakref.WeakMethod(join) if inspect.ismethod(join) else (lambda: join)
        self._joins = (*(j for j in self._joins if j() is not None), held)

    def _join(self) -> None:
        for held in self._joins:
            join = held()
            if join is not None:
                join()

    @abc.abstractmethod
    def memory(self) -> MemoryReport:
        """What this pool's tensors take (this rank's, for a striped pool), by purpose."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Check the whole state (synchronises); each pool kind knows its own state."""

    def _after_call(self) -> None:
        """After every call that changes the pool: under ``ULAKV_DEBUG=1``, the whole-state check
        (``check_invariants``); a ``TieredPool`` also checks each finished plan's decisions."""
        if self._debug and self.device.type != "meta":  # a capacity plan's pool holds no state to check
            self.check_invariants()

    @property
    def capacity(self) -> int:
        """Logical addresses (tokens) the pool can hold at once."""
        return self._allocator.capacity

    @property
    def free_addresses(self) -> int:
        """Addresses that can still be admitted (``capacity`` minus the live ones)."""
        return self._allocator.free

    @property
    def num_groups(self) -> int:
        """Layer groups: each has its own residency, mapping and policy state."""
        return self.config.num_groups

    def group_layers(self, group: int) -> range:
        """The layers of ``group`` (consecutive), which share its selection and slots."""
        self._check_group(group)
        return self.config.group_layers(group)

    def _need_kernels(self, what: str) -> None:
        if self.device.type == "meta":
            raise UlakvError(f"{what}: a pool on the meta device plans capacity and holds no data")

    def _check_group(self, group: int) -> None:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise InvalidInputError(f"group must be an int in [0, {self.num_groups}), got {group!r}")

    def _check_layer(self, layer: int) -> None:
        n = self.config.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise InvalidInputError(f"layer must be an int in [0, {n}), got {layer!r}")

    def _check_device(self, what: str, t: torch.Tensor) -> None:
        if not same_device(t, self.device):
            raise InvalidInputError(f"{what} is on {t.device}, the pool on {self.device}")

    def _check_selection(self, topk: object) -> None:
        """A prepare's ``topk``: an int32 or int64 tensor ``[batch, k]`` or ``[batch, q, k]`` on the
        pool's device (any strides or offset: it is read through ``readable_indices``)."""
        if not isinstance(topk, torch.Tensor):
            raise InvalidInputError(f"prepare: topk must be a tensor, got {type(topk).__name__}")
        if topk.dtype not in (torch.int32, torch.int64):
            raise InvalidInputError(f"prepare: topk must be int32 or int64, got {topk.dtype}")
        if topk.dim() not in (2, 3):
            raise InvalidInputError(
                f"prepare: topk must be [batch, k] or [batch, q, k], got shape {tuple(topk.shape)}"
            )
        self._check_device("prepare: topk", topk)

    def _check_addresses(self, what: str, addrs: object) -> None:
        """``addrs`` of ``read``, ``residency`` and ``write``: an int32 or int64 tensor."""
        if not isinstance(addrs, torch.Tensor) or addrs.dtype not in (torch.int32, torch.int64):
            got = addrs.dtype if isinstance(addrs, torch.Tensor) else type(addrs).__name__
            raise InvalidInputError(f"{what}: addrs must be an int32 or int64 tensor, got {got}")

    def _check_write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor, what: str = "write") -> None:
        """A write's layer, addresses (int32/int64 ``[n]``) and rows (uint8 ``[n, bytes]``); ``what``
        names the call in the errors (a prepare's new rows are checked the same way)."""
        self._check_layer(layer)
        self._need_kernels(what)
        self._check_addresses(what, addrs)
        if addrs.dim() != 1:
            raise InvalidInputError(f"{what}: addrs must be 1-D, got shape {tuple(addrs.shape)}")
        width = self.config.entry.bytes_per_layer
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
            got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InvalidInputError(
                f"{what}: rows must be uint8 [n, {width}] (view other dtypes with .view(torch.uint8)), "
                f"got {got}"
            )
        if rows.shape != (addrs.numel(), width):
            raise InvalidInputError(
                f"{what}: rows must have shape ({addrs.numel()}, {width}), got {tuple(rows.shape)}"
            )
        self._check_device(f"{what}: addrs", addrs)
        self._check_device(f"{what}: rows", rows)

    def _check_seq(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence) or seq.pool_id != self._id:
            raise InvalidAddressError("the sequence does not belong to this pool")
        if seq.released:
            raise InvalidAddressError(f"sequence {seq.seq_id} was already released")
