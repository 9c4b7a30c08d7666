"""``install()``: SGLang's HiSparse coordinator, KV pool and allocator replaced by ulakv's.

SGLang loads general plugins (entry point group ``sglang.srt.plugins``) in every process it starts,
scheduler workers included, and applies the class replacements they register before building the
model runner. ulakv's entry point is this ``install``; it does nothing unless ``ULAKV_SGLANG=1`` is
set, so installing ulakv beside SGLang changes nothing by itself. With it, a server launched with
``--enable-hisparse`` runs on ulakv (see the README for the command), and so does one launched with
``--enable-hisparse --dcp-size N``, which SGLang alone refuses (``dcp_hooks``).
"""

from __future__ import annotations

import logging
import os

from ...errors import UlakvError
from .allocator import UlakvAllocatorMixin
from .coordinator import UlakvSparseCoordinator
from .dcp_hooks import DCP_HOOKS
from .kv_pool import UlakvKVPoolMixin
from .version import SGLANG_VERSION

logger = logging.getLogger(__name__)

#: What ``install`` replaces: SGLang's dotted name -> how ulakv's class is built from SGLang's base.
TARGETS = {
    "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator": None,
    "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool": (
        "sglang.srt.mem_cache.memory_pool",
        "DSATokenToKVPool",
    ),
    "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator": (
        "sglang.srt.mem_cache.allocator.base",
        "BaseTokenToKVPoolAllocator",
    ),
}


def install(force: bool = False) -> bool:
    """Register ulakv's classes with SGLang's hook registry (when ``ULAKV_SGLANG=1`` or ``force``);
    returns whether it did. Refuses an SGLang other than the pinned release unless
    ``ULAKV_SGLANG_ANY_VERSION=1``: the adapter follows that release's internals."""
    if not force and os.environ.get("ULAKV_SGLANG", "0") in ("", "0"):
        return False
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.version import __version__

    if __version__ != SGLANG_VERSION and os.environ.get("ULAKV_SGLANG_ANY_VERSION", "0") in ("", "0"):
        raise UlakvError(
            f"the ulakv SGLang adapter is written against sglang {SGLANG_VERSION}, found {__version__} "
            "(set ULAKV_SGLANG_ANY_VERSION=1 to try anyway; run the conformance check first)"
        )
    mixins = {
        "HiSparseDSATokenToKVPool": (UlakvKVPoolMixin, "UlakvDSATokenToKVPool"),
        "HiSparseTokenToKVPoolAllocator": (UlakvAllocatorMixin, "UlakvTokenToKVPoolAllocator"),
    }
    for target, base in TARGETS.items():
        if base is None:
            replacement = UlakvSparseCoordinator
        else:
            module, name = base
            mixin, class_name = mixins[target.rsplit(".", 1)[1]]
            sglang_base = getattr(importlib.import_module(module), name)
            replacement = type(class_name, (mixin, sglang_base), {"__module__": mixin.__module__})
        HookRegistry.register(target, replacement, HookType.REPLACE)
    for target, (kind, hook) in DCP_HOOKS.items():
        HookRegistry.register(target, hook, HookType[kind])
    logger.info("ulakv: SGLang's HiSparse coordinator, KV pool and allocator replaced; DCP hooks registered")
    return True
