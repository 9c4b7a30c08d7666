"""One detector for the whole suite: every host synchronisation in a block becomes an error.

``with no_host_sync(): ...`` raises ``HostSyncError`` at the first operation that reads device data
back to the host or whose output shape depends on device data. It is a ``TorchDispatchMode``, so it
sees every aten operation, however it was reached (methods, functions, indexing, Python operators,
C++ composites):

- ``aten._local_scalar_dense`` and everything tagged ``data_dependent_output`` (``item``, ``bool(t)``,
  ``int(t)``, ``float(t)``, indexing with a 0-d tensor, ``torch.equal``, ``allclose``);
- everything tagged ``dynamic_output_shape`` (``nonzero``/``argwhere``, ``masked_select``, the
  ``unique`` family, ``bincount``, ...), but for two ops whose shape is only sometimes data-dependent:
  ``index.Tensor`` (flagged with a bool/uint8 index: ``t[mask]``) and ``repeat_interleave.Tensor``
  (flagged without ``output_size``); ``nonzero_static`` is fixed-size and allowed;
- what the tags miss: ``index_put``/``index_put_`` with a bool/uint8 index (``t[mask] = v``), a histogram
  whose range comes from the data, ``masked_fill``/``index_fill`` with a device 0-d value (the kernel
  reads it with ``item``), ``_linalg_check_errors``, dense-to-sparse conversions and coalescing
  (their ``nnz`` is data), the sparse argument validations;
- device-to-host copies: ``_to_copy``, ``copy_``, ``_copy_from``, ``fill_`` with a device value, ...
  from a non-CPU tensor into a CPU one (``_copies_to_host``; on a GPU that is every ``.cpu()``,
  ``.tolist()``, ``.numpy()``, ``print``; ``non_blocking`` included: the data is no use until a sync),
  but for one pattern: ``copy_`` with ``non_blocking=True`` into pinned memory, which the host reads
  only once an event says it landed (``Event.query``, never a wait: ``ulakv.deferred``).

Some host reads never reach the dispatcher, so they are guarded in Python while the block runs:
``Tensor.tolist`` and ``Tensor.numpy`` (no aten op on a CPU tensor: without the guard the detector
would be blind to them on the CPU, where tests run), ``Tensor.__repr__`` (tensor printing turns
dispatch modes off), and the explicit ``synchronize`` calls of ``torch.cuda`` and ``torch.accelerator``.

The Triton interpreter turns tensors into host arrays by design, and may call aten ops doing it: that
is not the pool synchronising. An operation is exempt when the innermost Python frame belonging to
``tests/``, ``ulakv/`` or ``triton`` is triton's. A sync that ulakv or test code makes itself, even
when triton called that code (a grid function, a hook), has a ulakv or test frame innermost and is
reported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ulakv
from ulakv.frame import debug_enabled


class HostSyncError(AssertionError):
    """A hot-path call synchronised with the host."""


_THIS_FILE = os.path.abspath(__file__)
_TESTS_DIR = os.path.dirname(_THIS_FILE) + os.sep
_ULAKV_DIR = os.path.dirname(os.path.abspath(ulakv.__file__)) + os.sep


def _triton_dir() -> str:
    import triton

    return os.path.dirname(os.path.abspath(triton.__file__)) + os.sep


def _called_by_triton(triton_dir: str) -> bool:
    """True when the innermost caller that is ours (tests/, this file aside), ulakv's or triton's is
    triton's. Frames of torch, the standard library and this module are looked through."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(triton_dir):
            return True
        if name != _THIS_FILE and (name.startswith(_ULAKV_DIR) or name.startswith(_TESTS_DIR)):
            return False
        frame = frame.f_back
    return False


# -- the decision: does this aten call read device data back? ---------------------------------------

aten = torch.ops.aten

# Devices whose memory the host reads directly ("meta" has none: nothing to read back).
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})

# Always allowed although a tag or a name would say otherwise.
_ALLOWED = frozenset({aten.nonzero_static.default, aten.nonzero_static.out})

# Index ops whose output (or accepted value) shape depends on the data with a boolean index.
_INDEX_OPS = frozenset(
    {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}
)
_MASK_DTYPES = (torch.bool, torch.uint8)

# Not tagged, yet reading data back on the host (on CUDA, by the kernel itself).
_READS_BACK = frozenset(
    {
        "_linalg_check_errors",  # reads the info tensor to raise
        "_to_sparse",
        "_to_sparse_csr",
        "_to_sparse_csc",
        "_to_sparse_bsr",
        "_to_sparse_bsc",
        "_coalesce",  # nnz after merging duplicates
        "_validate_sparse_coo_tensor_args",
        "_validate_sparse_compressed_tensor_args",
        "_validate_sparse_csr_tensor_args",
        "_validate_sparse_csc_tensor_args",
        "_validate_sparse_bsr_tensor_args",
        "_validate_sparse_bsc_tensor_args",
        "_validate_compressed_sparse_indices",
    }
)

# Ops whose Tensor ``value`` becomes a Scalar inside the kernel (``value.item()``).
_SCALAR_OF_TENSOR = frozenset({"masked_fill", "masked_fill_", "index_fill", "index_fill_"})

# Ops that may copy data across devices (``_copy_pairs`` says from where to where).
_COPY_OPS = frozenset(
    {"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize", "fill_", "fill"}
    | {"_foreach_copy_", "_foreach_copy", "_to_cpu"}
)


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name (defaults filled in)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def _device_of(x: object) -> torch.device | None:
    if isinstance(x, torch.Tensor):
        return x.device
    if isinstance(x, (torch.device, str)):
        return torch.device(x)
    return None


def is_device_to_host(src: torch.device | str | None, dst: torch.device | str | None) -> bool:
    """Data moving from ``src`` to ``dst`` is a device-to-host read-back (GPU or any accelerator to
    CPU)."""
    if src is None or dst is None:
        return False
    return torch.device(src).type not in _HOST_DEVICE_TYPES and torch.device(dst).type == "cpu"


def _copy_pairs(name: str, bound: dict[str, Any]) -> list[tuple[object, object]]:
    """(source, destination) of the data an op copies, for the ops that can cross devices."""
    if name == "_to_copy":
        src = bound["self"]
        return [(src, bound["device"] if bound["device"] is not None else src)]
    if name in ("copy_", "copy"):
        return [(bound["src"], bound["self"])]
    if name in ("_copy_from", "_copy_from_and_resize"):
        return [(bound["self"], bound["dst"])]
    if name in ("fill_", "fill"):  # fill_.Tensor on a CPU tensor with a device value: value.item()
        return [(bound["value"], bound["self"])]
    if name in ("_foreach_copy_", "_foreach_copy"):
        return list(zip(bound["src"], bound["self"], strict=False))
    if name == "_to_cpu":
        return [(t, "cpu") for t in bound["tensors"]]
    return []


def _copies_to_host(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """The call copies data from a non-CPU device into CPU memory."""
    name = func._opname if func.namespace == "aten" else ""
    if name not in _COPY_OPS:
        return False
    bound = _bind(func, args, kwargs)
    if name == "copy_" and bound.get("non_blocking") and bound["self"].is_pinned():
        return False  # an asynchronous copy into pinned memory: no sync until someone waits for it
    return any(is_device_to_host(_device_of(s), _device_of(d)) for s, d in _copy_pairs(name, bound))


def sync_reason(func: torch._ops.OpOverload, args: tuple = (), kwargs: dict | None = None) -> str | None:
    """Why calling ``func(*args, **kwargs)`` reads device data back to the host; ``None`` if it
    does not."""
    kwargs = kwargs or {}
    if func in _ALLOWED:
        return None
    name = func._opname if func.namespace == "aten" else ""  # the rules by name are aten's
    if name in _INDEX_OPS:
        indices = _bind(func, args, kwargs)["indices"]
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ()):
            return "a boolean mask index (its shape is the number of true elements)"
        return None
    if name == "repeat_interleave":
        bound = _bind(func, args, kwargs)
        if "repeats" in bound and isinstance(bound["repeats"], torch.Tensor) and bound["output_size"] is None:
            return "repeat_interleave without output_size (its size is the sum of the repeats)"
        return None
    tags = func.tags
    if torch.Tag.data_dependent_output in tags:
        return "a value read back to the host"
    if torch.Tag.dynamic_output_shape in tags:
        return "an output shape that depends on the data"
    if name in _READS_BACK or name.startswith("_validate_sparse"):
        return "data read back by the operation itself"
    if name == "histc":
        bound = _bind(func, args, kwargs)
        if bound["min"] == bound["max"]:
            return "a histogram range taken from the data (min == max)"
        return None
    if name in _SCALAR_OF_TENSOR:
        value = _bind(func, args, kwargs).get("value")
        if isinstance(value, torch.Tensor) and value.device.type not in _HOST_DEVICE_TYPES:
            return "a device 0-d tensor used as a scalar (the kernel reads it with item)"
        return None
    if _copies_to_host(func, args, kwargs):
        return "a device-to-host copy"
    return None


class _NoHostSync(TorchDispatchMode):
    def __init__(self, triton_dir: str) -> None:
        super().__init__()
        self.triton_dir = triton_dir

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None and not _called_by_triton(self.triton_dir):
            raise HostSyncError(f"hot path synchronised with the host: {func} ({reason})")
        return func(*args, **kwargs)


# -- host reads the dispatcher does not see --------------------------------------------------------


def _python_targets() -> list[tuple[object, str]]:
    targets: list[tuple[object, str]] = [
        (torch.Tensor, "tolist"),  # no aten op on a CPU tensor (a _to_copy on CUDA)
        (torch.Tensor, "numpy"),  # likewise (np.asarray(t) and t.__array__ call it)
        (torch.Tensor, "__repr__"),  # tensor printing runs with dispatch modes off
        (torch.cuda, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda.Event, "synchronize"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize"))
    return targets


def _guard(original: Callable, name: str, triton_dir: str) -> Callable:
    def guarded(*args: object, **kwargs: object) -> object:
        if _called_by_triton(triton_dir):
            return original(*args, **kwargs)
        raise HostSyncError(f"hot path synchronised with the host: {name}")

    return guarded


_MISSING = object()


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Every host synchronisation inside the block raises ``HostSyncError`` (see the module)."""
    triton_dir = _triton_dir()
    saved: list[tuple[object, str, object]] = []
    try:
        for owner, name in _python_targets():
            saved.append((owner, name, vars(owner).get(name, _MISSING)))  # inherited: delete after
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, _guard(getattr(owner, name), label, triton_dir))
        with _NoHostSync(triton_dir):
            yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# ULAKV_DEBUG=1 validates every call and checks the pool after it: host syncs by design.
skip_under_debug = pytest.mark.skipif(
    debug_enabled(),
    reason="ULAKV_DEBUG=1 synchronises on purpose (validation and invariant checks)",
)
