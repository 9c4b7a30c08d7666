"""The SGLang adapter: ulakv in place of SGLang's HiSparse coordinator, KV pool and allocator.

Written against sglang 0.5.23 (``SGLANG_VERSION``). Nothing here imports SGLang until ``install()``
runs inside an SGLang process (its plugin entry point) or a coordinator is built there.
"""

from .coordinator import UlakvSparseCoordinator, UnsupportedBySGLangAdapter
from .plugin import install
from .store import SGLangStore, StoreConfig
from .version import SGLANG_VERSION

__all__ = [
    "SGLANG_VERSION",
    "SGLangStore",
    "StoreConfig",
    "UlakvSparseCoordinator",
    "UnsupportedBySGLangAdapter",
    "install",
]
