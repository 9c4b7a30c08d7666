"""Import triton so that kernels run everywhere: on a GPU natively, elsewhere under the interpreter.

Triton reads TRITON_INTERPRET once, when it is first imported. On a machine without CUDA we set it
before that import, so ``device="cpu"`` pools work out of the box; set TRITON_INTERPRET yourself to
override. Every kernel module imports ``triton`` and ``tl`` from here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["INTERPRETED", "count_launches", "tl", "triton"]


_language_core = tl.core  # with ``tl`` in this module's globals: every namespace the kernels use


def _patch_language_once_per_launch() -> None:
    """Interpreter speed-up, nothing else. The interpreter re-patches triton.language (five
    ``inspect.getmembers`` scans, about 2 ms) at every call of a nested ``@triton.jit`` function, and
    ``tl.sum``, ``tl.cumsum``, ``tl.max`` are such functions: most of an interpreted ``prepare`` went
    there. Patch once per launch instead, covering both namespaces, and skip nested re-patching."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without the interpreter module
        return
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_ulakv", False):
        return
    depth = [0]

    class _Nested:
        def restore(self) -> None:
            pass

    def _anchor() -> None:  # its globals hold tl and tl.core
        return None

    def patch_lang(fn):
        if depth[0]:
            return _Nested()
        scope = original(_anchor)
        depth[0] += 1
        restore = scope.restore

        def restore_once() -> None:
            depth[0] -= 1
            restore()

        scope.restore = restore_once
        return scope

    patch_lang._ulakv = True
    interpreter._patch_lang = patch_lang


if INTERPRETED:
    _patch_language_once_per_launch()


@contextlib.contextmanager
def count_launches() -> Iterator[list[str]]:
    """Record the name of every Triton kernel launched inside the block, in order: what the hot
    path really costs, counted at Triton's launch entry (not by our own bookkeeping)."""
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction as launcher
    else:
        from triton.runtime.jit import JITFunction as launcher
    original = launcher.run
    names: list[str] = []

    def run(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    launcher.run = run
    try:
        yield names
    finally:
        launcher.run = original
