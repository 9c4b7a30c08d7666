"""A patch that turns every host synchronisation into an error, for hot-path tests.

Reading device data back (``item``, ``tolist``, ``bool(t)``, ...) or making a shape depend on data
(``nonzero``, ``unique``, ...) raises ``HostSyncError`` while ``no_host_sync`` is active, unless the
Triton interpreter does it (it turns tensors into numpy arrays by design; that is not the pool
synchronising).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

import ulakv


class HostSyncError(AssertionError):
    """A hot-path call synchronised with the host."""


_TESTS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ULAKV_DIR = os.path.dirname(os.path.abspath(ulakv.__file__)) + os.sep


def _triton_dir() -> str:
    import triton

    return os.path.dirname(os.path.abspath(triton.__file__)) + os.sep


def _called_by_triton(triton_dir: str) -> bool:
    """True when the innermost caller that is ours, ulakv's or triton's is triton's.

    The Triton interpreter turns tensors into numpy arrays on the host by design; that is not the
    pool syncing.
    """
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(triton_dir):
            return True
        if name.startswith(_ULAKV_DIR) or name.startswith(_TESTS_DIR):
            return False
        frame = frame.f_back
    return False


# Everything that reads device data back to the host or makes a shape depend on data.
_SYNC_TARGETS: list[tuple[object, str]] = [
    (torch.Tensor, "item"),
    (torch.Tensor, "tolist"),
    (torch.Tensor, "numpy"),
    (torch.Tensor, "__bool__"),
    (torch.Tensor, "__int__"),
    (torch.Tensor, "__float__"),
    (torch.Tensor, "__index__"),
    (torch.Tensor, "nonzero"),
    (torch.Tensor, "unique"),
    (torch.Tensor, "unique_consecutive"),
    (torch, "unique"),
    (torch, "unique_consecutive"),
    (torch, "nonzero"),
    (torch, "argwhere"),
    (torch, "masked_select"),
]


@contextlib.contextmanager
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    triton_dir = _triton_dir()
    with monkeypatch.context() as mp:
        for owner, name in _SYNC_TARGETS:
            original = getattr(owner, name)

            def guarded(*args: object, _original=original, _name=name, **kwargs: object) -> object:
                if _called_by_triton(triton_dir):
                    return _original(*args, **kwargs)
                raise HostSyncError(f"hot path called {_name}")

            mp.setattr(owner, name, guarded)
        yield


# ULAKV_DEBUG=1 validates every call and checks every invariant after it: host syncs by design.
skip_under_debug = pytest.mark.skipif(
    os.environ.get("ULAKV_DEBUG", "0") not in ("", "0"),
    reason="ULAKV_DEBUG=1 synchronises on purpose (validation and invariant checks)",
)
