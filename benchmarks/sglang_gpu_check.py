"""The SGLang adapter on a CUDA machine with SGLang installed: what the CPU tests cannot check.

    python benchmarks/sglang_gpu_check.py --out sglang_gpu.json
    python benchmarks/sglang_gpu_check.py --checks install,kv_pool_roundtrip   # a subset, in suite order

Needs ``sglang==0.5.23`` with its CUDA packages (``sgl_kernel``, ``flash_mla``) and ulakv installed in
the same environment, and one CUDA GPU that runs SGLang's DSA kernels (SM90 or newer). Planned at a
few minutes, most of it compiling SGLang's and ulakv's kernels; each check's wall time is recorded.

Why not on CPU: the CPU tests (``tests/test_sglang_adapter.py``, ``tests/test_sglang_conformance.py``)
never import ``sglang`` (its ``__init__`` needs CUDA-only packages); they load one dependency-free file
of the pinned wheel and read the rest with ``ast``. So SGLang's own classes composed with ours,
SGLang's FP8 row writer (Triton / JIT CUDA), FlashMLA reading our buffers and CUDA-graph capture are
only ever checked here.

Checks, in order, each independent (a failure is reported and the next check runs):

1. ``version``: the installed sglang is the pinned release (``SGLANG_VERSION``).
2. ``conformance``: ``tools.sglang_conformance`` on the *installed* package's source:
   our three classes have every member SGLang uses, with signatures that take SGLang's calls.
3. ``install``: ``install(force=True)`` and SGLang's ``HookRegistry.apply_hooks()`` replace
   ``HiSparseCoordinator`` by ours and the HiSparse pool / allocator by subclasses of our mixins (in
   their modules and in ``kv_cache_configurator``, which builds them); the ``sglang.srt.plugins``
   entry point names ``install``.
4. ``kv_pool_roundtrip``: the replaced ``HiSparseDSATokenToKVPool`` (FP8, 656-byte rows) against a
   plain ``DSATokenToKVPool``: the same bf16 ``cache_k_nope`` / ``cache_k_rope`` written through
   ``set_mla_kv_buffer`` on both (a padding ``loc`` 0 in each call), our rows read back through
   ``ulakv_store.slots`` into ``kv_buffer`` must be byte-equal to the reference's ``kv_buffer[loc]``;
   again after writing more tokens than the GPU cache holds, selecting newer ones until the first are
   evicted to the CPU tier, and selecting the first again.
5. ``flashmla_sparse_decode``: a bf16 pool (576 values a row); FlashMLA's sparse kernel called as
   ``DeepseekSparseAttnBackend._forward_flashmla_sparse`` calls it, once over our ``kv_buffer`` with the
   coordinator's slots, once over the reference's with SGLang's non-HiSparse page table
   (``transform_index_page_table_decode``); same queries, outputs bit-identical. SKIP without flash_mla.
6. ``coordinator_decode``: ``UlakvSparseCoordinator.from_store`` with SGLang's transform; 8 requests of
   3000 tokens (three share prefixes) in a batch padded to 10, top-k 2048, ``num_real_reqs`` 8: the
   slots read back the written rows, padding requests and positions read nothing (also when padding
   rows name real requests); then the step captured in a CUDA graph after a warm-up and replayed on
   new top-k written into its input buffer.
7. ``flashmla_kv_decode``: as 5 for the FP8 pool and the kernel SGLang decodes an FP8 DSA cache with
   (``_forward_flashmla_kv``: ``flash_mla_with_kvcache``, ``is_fp8_kvcache``, format ``V32``).
8. ``decode_step_graph``: as 6, but the captured step is a whole decode step as SGLang's decode graph
   holds it: per layer the new tokens' rows written (``pool.write`` inside the graph), then the
   swap-in; the replays read each request's newest token too.
9. ``allocator``: the replaced ``HiSparseTokenToKVPoolAllocator`` over the replaced pool: ``alloc``
   makes exactly its ``loc`` live in the pool, ``free`` releases them (homes freed), ``clear`` empties.
10. ``dcp_hooks``: after ``install``, SGLang's ``localize_dcp_page_table`` (in ``dsa_dcp`` and the
    backend's binding), ``DeepseekSparseAttnBackend.__init__`` / ``_forward_trtllm`` are wrapped, and
    ``_dsa_dcp_overrides`` lets HiSparse through with the trtllm backends, refusing another by flag.
11. ``dcp_localize``: a DCP group of 4 simulated on one GPU (each rank in turn, SGLang's parallel
    context overridden): each rank builds the replaced pool under DCP (a ``SGLangDcpStore``; SGLang's
    DCP row writer), writes every token's rows through ``set_mla_kv_buffer`` and localises a decode
    page table with padding requests through SGLang's hooked ``localize_dcp_page_table``; the rows
    read through its block table equal, in order, the dense rows ``transform_index_page_table_dcp``
    selects, with its counts; the localisation replays in a CUDA graph.

In 5 and 7 both pools hold the same bytes (SGLang's writer fills the reference, its rows are copied
into ours as bytes) so that a difference there is FlashMLA reading our buffers, not the writer (4).

Prints one line per check (PASS / FAIL / SKIP, wall seconds, a reason; a failure's exception below
it), writes everything to ``--out`` as JSON and exits 1 if any check failed. Last it prints a
markdown block to paste into ``benchmarks/RESULTS.md`` as its section "SGLang adapter on a GPU"
(a new section at the end; a later run replaces it): date, commit, device, sglang / flash-mla /
sgl-kernel / torch versions, the command, and one table row per check (result, seconds, reason).
Paste it whatever the result: a FAIL row with its reason is the finding; keep the JSON beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import io
import json
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tools/ (conformance)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_harness, beside this script
from gpu_harness import Failed, SectionResult, Skip, in_suite_order, result_rows, run_section, section_names

# Only the standard library here: the script must import (and ``--help`` answer) without SGLang, and
# quickly; torch, ulakv and sglang are imported inside the checks.
if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda"  # every tensor of the checks lives here (one name, so a dry run can move them)

# DeepSeek-V3.2 / GLM-5 DSA shapes (SGLang's own DSA test kit uses the same: page 64, index head 128).
PAGE = 64
KV_LORA_RANK = 512
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
LAYERS = 2
TOP_K = 2048  # transform_index_page_table_decode's single-program kernel and FlashMLA decode's width
RATIO = 2  # HiSparse's host_to_device_ratio: live loc = device tokens x 2
HEADS = 128  # query heads: a multiple of 64 (SM90) and 128 (SM100), so no head padding is needed
FP8_ROW = 656  # 512 fp8 values + 4 fp32 scales + 64 bf16 rope values, bytes

# SGLang's parallel context for one process without a server. SGLang's kernels read these
# (``set_mla_kv_buffer_dcp_sharded_triton``, ``MLATokenToKVPool._write_loc_dcp_span``); a server
# publishes them, SGLang's unit-test kits override them the same way (``dense_attention.py``,
# ``dsa_attention.py`` under ``sglang/test/kits/attention_unittest``).
SINGLE_RANK = {
    "attn_dcp_size": 1,
    "attn_dcp_rank": 0,
    "dcp_enabled": False,
    "attn_tp_size": 1,
    "attn_tp_rank": 0,
    "attn_cp_size": 1,
    "attn_cp_rank": 0,
}

TARGET_COORDINATOR = ("sglang.srt.managers.hisparse_coordinator", "HiSparseCoordinator")
TARGET_POOL = ("sglang.srt.mem_cache.hisparse_memory_pool", "HiSparseDSATokenToKVPool")
TARGET_ALLOCATOR = ("sglang.srt.mem_cache.allocator.hisparse", "HiSparseTokenToKVPoolAllocator")


# -- helpers: what is installed ------------------------------------------------------------------------
def _pinned() -> str:
    from ulakv.integrations.sglang.version import SGLANG_VERSION

    return SGLANG_VERSION


def _dist_version(*names: str) -> str | None:
    """The installed version of the first distribution of ``names`` found (local metadata only)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _sglang_version() -> str | None:
    """The installed sglang's version (its distribution metadata; ``sglang.version`` for a source tree
    on the path), None when it is not installed."""
    if importlib.util.find_spec("sglang") is None:
        return None
    version = _dist_version("sglang")
    if version is None:  # a source tree on the path, not an installed distribution
        from sglang.version import __version__

        version = str(__version__)
    return version


def _require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise Failed(f"sglang is not installed (the adapter is pinned to sglang=={_pinned()})")


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise Failed("needs a CUDA device: torch.cuda.is_available() is False")


def _sglang_source_dir() -> Path:
    """The directory holding the installed ``sglang/`` package (its site-packages, or a checkout)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise Failed(f"sglang is not installed (the adapter is pinned to sglang=={_pinned()})")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


@contextlib.contextmanager
def _single_rank() -> Iterator[None]:
    """SGLang's parallel names a one-process run needs, for names nothing has set (scoped)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    values = {}
    for name, value in SINGLE_RANK.items():
        try:
            getattr(parallel, name)
        except AttributeError:  # not a parallel name in this SGLang: nothing reads it
            continue
        except Exception:  # declared but neither published nor overridden
            values[name] = value
    with parallel.override(**values):
        yield


def _installed_classes() -> tuple[type, type]:
    """The replaced HiSparse pool and allocator classes; installs ulakv first if no check has."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from ulakv.integrations.sglang import install
    from ulakv.integrations.sglang.allocator import UlakvAllocatorMixin
    from ulakv.integrations.sglang.kv_pool import UlakvKVPoolMixin

    pool_mod = importlib.import_module(TARGET_POOL[0])
    if not issubclass(getattr(pool_mod, TARGET_POOL[1]), UlakvKVPoolMixin):
        install(force=True)
        HookRegistry.apply_hooks()
    pool_cls = getattr(pool_mod, TARGET_POOL[1])
    alloc_cls = getattr(importlib.import_module(TARGET_ALLOCATOR[0]), TARGET_ALLOCATOR[1])
    if not issubclass(pool_cls, UlakvKVPoolMixin) or not issubclass(alloc_cls, UlakvAllocatorMixin):
        raise Failed("install() did not replace SGLang's HiSparse pool / allocator (see the install check)")
    return pool_cls, alloc_cls


# -- helpers: pools, requests, rows ---------------------------------------------------------------------
def _kv_cache_dim(fp8: bool) -> int:
    """The row SGLang sizes for a DSA model (``calculate_mla_kv_cache_dim``, kv_cache_configurator.py):
    FP8 with FlashMLA's scaled layout, else ``kv_lora_rank + qk_rope_head_dim`` values."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    if not fp8:
        return KV_LORA_RANK + ROPE_DIM
    block = DSATokenToKVPool.quant_block_size
    return KV_LORA_RANK + KV_LORA_RANK // block * 4 + ROPE_DIM * DSATokenToKVPool.rope_storage_dtype.itemsize


def _pool_kwargs(fp8: bool, max_running_requests: int) -> dict[str, Any]:
    """The keywords ``_build_dsa_kv_pool`` (kv_cache_configurator.py) passes a DSA pool, ``size`` aside."""
    import torch

    return {
        "page_size": PAGE,
        "dtype": torch.float8_e4m3fn if fp8 else torch.bfloat16,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": ROPE_DIM,
        "layer_num": LAYERS,
        "device": DEVICE,
        "kv_cache_dim": _kv_cache_dim(fp8),
        "enable_memory_saver": False,
        "index_head_dim": INDEX_HEAD_DIM,
        "max_running_requests": max_running_requests,
    }


def _our_pool(pool_cls: type, size: int, fp8: bool, max_running_requests: int) -> Any:
    """The replaced pool, built as SGLang builds it: ``size`` device tokens, ``size x RATIO`` live loc."""
    return pool_cls(size, host_to_device_ratio=RATIO, **_pool_kwargs(fp8, max_running_requests))


def _reference_pool(size: int, fp8: bool, max_running_requests: int) -> Any:
    """A plain ``DSATokenToKVPool`` whose rows cover every ``loc`` ours may hand out (``size``)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(size, **_pool_kwargs(fp8, max_running_requests))


def _layer(layer_id: int) -> SimpleNamespace:
    """What the pools read of SGLang's ``RadixAttention`` layer when writing: its ``layer_id``."""
    return SimpleNamespace(layer_id=layer_id)


def _byte_rows(buf: torch.Tensor) -> torch.Tensor:
    """A ``kv_buffer[layer]`` (``[rows, 1, dim]`` of any dtype) as uint8 ``[rows, bytes]``."""
    import torch

    return buf.reshape(buf.shape[0], -1).view(torch.uint8)


def _store_config(store: Any) -> dict[str, str]:
    """The ulakv store's sizes as the pool's constructor chose them (environment variables included)."""
    return {f.name: str(getattr(store.config, f.name)) for f in fields(store.config)}


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _capture(step: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """``step`` captured in a CUDA graph (the caller has warmed it up): the tensors it returned, which
    each replay refills, and the replay."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return outputs, graph.replay


@dataclass
class Requests:
    """SGLang's bookkeeping for one batch: ``ReqToTokenPool`` rows (row 0: padding requests), each
    request's ``loc`` by position, and the ``loc`` each request allocated itself (prefix sharers do
    not own their shared prefix)."""

    pool: Any  # sglang ReqToTokenPool
    rows: list[int]  # each request's row of req_to_token
    tokens: list[torch.Tensor]  # int64 cpu [seq_len] loc by position
    own: list[torch.Tensor]  # int64 cpu: the loc each request allocated
    next_free: torch.Tensor  # int64 cpu: unused loc, in allocation order

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.pool.req_to_token

    def all_own(self) -> torch.Tensor:
        import torch

        return torch.cat(self.own)

    def take(self, n: int) -> torch.Tensor:
        """``n`` fresh loc (a decode step's ``out_cache_loc``), int64 cpu."""
        out, self.next_free = self.next_free[:n], self.next_free[n:]
        if out.numel() < n:
            raise Failed("the check ran out of loc: its sizes are wrong")
        return out


def _make_requests(
    lens: list[int],
    shares: dict[int, tuple[int, int]],
    loc_space: int,
    max_reqs: int,
    context: int,
    seed: int,
) -> Requests:
    """Requests of ``lens`` tokens; request ``i`` in ``shares`` starts with the first ``k`` tokens of
    request ``j`` (``shares[i] = (j, k)``, a prefix-cache hit). ``loc`` come from ``[1, loc_space)``
    shuffled, as an allocator hands them out after some churn; rows from the pool's tail, as
    ``ReqToTokenPool.alloc_rows`` takes them."""
    import torch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    gen = torch.Generator().manual_seed(seed)
    rtp = ReqToTokenPool(size=max_reqs, max_context_len=context, device=DEVICE, enable_memory_saver=False)
    free = torch.randperm(loc_space - 1, generator=gen).to(torch.int64) + 1
    reqs = Requests(rtp, [], [], [], free)
    for i, n in enumerate(lens):
        prefix = reqs.tokens[shares[i][0]][: shares[i][1]] if i in shares else free[:0]
        own = reqs.take(n - prefix.numel())
        seq = torch.cat([prefix, own])
        row = max_reqs - i
        rtp.req_to_token[row, :n] = seq.to(DEVICE, torch.int32)
        reqs.rows.append(row)
        reqs.tokens.append(seq)
        reqs.own.append(own)
    return reqs


def _topk(
    seq_lens: list[int], pad_rows: int, seed: int, holes: int = 0, newest: bool = False
) -> torch.Tensor:
    """The indexer's choice, int32 ``[len(seq_lens) + pad_rows, TOP_K]`` on cuda: distinct random
    positions of each request (its newest position first when ``newest``), ``-1`` past a short
    request's length and in the last ``holes`` entries of request 3; padding requests get garbage
    positions (what a captured batch's padding rows hold)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(seq_lens):
        perm = torch.randperm(n, generator=gen)
        if newest:
            perm = torch.cat([torch.tensor([n - 1]), perm[perm != n - 1]])
        row = torch.full((TOP_K,), -1, dtype=torch.int32)
        pos = perm[:TOP_K].to(torch.int32)
        row[: pos.numel()] = pos
        if holes and i == 3:
            row[-holes:] = -1
        rows.append(row)
    rows += [torch.randint(0, min(seq_lens), (TOP_K,), generator=gen, dtype=torch.int32)] * pad_rows
    return torch.stack(rows).to(DEVICE)


def _chunks(t: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, t.numel(), size):
        yield t[start : start + size]


def _mismatch(what: str, bad: torch.Tensor, where: torch.Tensor | None = None) -> str:
    """``what``: k of n rows differ; with ``where`` (each row's position in its write call), where."""
    k, n = int(bad.sum()), bad.numel()
    text = f"{what}: {k} of {n} rows differ"
    if where is not None:
        hist = Counter(where[bad.cpu()].tolist())
        text += (
            f"; their positions in their set_mla_kv_buffer call (position: rows): {dict(hist.most_common(5))}"
        )
        if set(hist) == {0}:
            text += (
                " -- only each call's first row: SGLang's row writer skips destination row 0 "
                "(reserved_skip_index=0), which the adapter's scratch uses"
            )
    return text


# -- 1. version ------------------------------------------------------------------------------------------
def check_version(details: dict[str, Any]) -> str:
    pinned = _pinned()
    installed = _sglang_version()
    details.update(pinned=pinned, installed=installed)
    if installed is None:
        raise Failed(f"sglang is not installed (the adapter is pinned to sglang=={pinned})")
    if installed != pinned:
        raise Failed(f"sglang {installed} is installed; the adapter is written against sglang {pinned}")
    return f"sglang {installed}"


# -- 2. conformance --------------------------------------------------------------------------------------
def check_conformance(details: dict[str, Any]) -> str:
    source = _sglang_source_dir()
    from tools import sglang_conformance as conformance

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = conformance.main(["--source", str(source)])
    text = out.getvalue()
    problems = [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- ")]
    problems += [line.strip() for line in text.splitlines() if "cannot import" in line]
    details.update(source=str(source), exit_code=code, problems=problems, output_tail=text[-4000:])
    if code != 0:
        first = problems[0] if problems else "see output_tail"
        raise Failed(f"{len(problems)} problem(s) against {source}; first: {first}")
    return f"coordinator, pool and allocator conform to the installed source ({source})"


# -- 3. install ------------------------------------------------------------------------------------------
def check_install(details: dict[str, Any]) -> str:
    _require_sglang()
    # The module that builds the pool and the allocator binds their names at import: importing it first
    # makes this check cover apply_hooks' propagation to such bindings (hook_registry._propagate_patch).
    builder = "sglang.srt.mem_cache.kv_cache_configurator"
    try:
        importlib.import_module(builder)
        details["preimported"] = builder
    except Exception as exc:  # reported, not fatal: the class replacements themselves are checked below
        details["preimported"] = f"{builder} did not import: {type(exc).__name__}: {exc}"
    from sglang.srt.plugins.hook_registry import HookRegistry

    from ulakv.integrations.sglang import UlakvSparseCoordinator, install
    from ulakv.integrations.sglang.allocator import UlakvAllocatorMixin
    from ulakv.integrations.sglang.kv_pool import UlakvKVPoolMixin

    if install(force=True) is not True:
        raise Failed("install(force=True) did not register anything")
    HookRegistry.apply_hooks()  # logs, not raises, a target it cannot patch: the checks below catch it

    problems = []
    coord = getattr(importlib.import_module(TARGET_COORDINATOR[0]), TARGET_COORDINATOR[1])
    if coord is not UlakvSparseCoordinator:
        problems.append(f"{'.'.join(TARGET_COORDINATOR)} is {coord!r}, not UlakvSparseCoordinator")
    memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
    pool_cls = getattr(importlib.import_module(TARGET_POOL[0]), TARGET_POOL[1])
    alloc_cls = getattr(importlib.import_module(TARGET_ALLOCATOR[0]), TARGET_ALLOCATOR[1])
    for cls, mixin, sglang_base, target in (
        (pool_cls, UlakvKVPoolMixin, memory_pool.DSATokenToKVPool, TARGET_POOL),
        (alloc_cls, UlakvAllocatorMixin, base.BaseTokenToKVPoolAllocator, TARGET_ALLOCATOR),
    ):
        if not (issubclass(cls, mixin) and issubclass(cls, sglang_base)):
            problems.append(
                f"{'.'.join(target)} is {cls!r}: not {mixin.__name__} over {sglang_base.__name__}"
            )
    built_by = sys.modules.get(builder)
    if built_by is not None:
        for name, want in ((TARGET_POOL[1], pool_cls), (TARGET_ALLOCATOR[1], alloc_cls)):
            if getattr(built_by, name, want) is not want:
                problems.append(f"{builder}.{name} still names SGLang's class (the patch did not propagate)")
    points = [
        ep
        for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
        if ep.value.split(":")[0].startswith("ulakv")
    ]
    details.update(
        coordinator=repr(coord),
        pool=f"{pool_cls.__module__}.{pool_cls.__qualname__} {[c.__name__ for c in pool_cls.__mro__[:3]]}",
        allocator=f"{alloc_cls.__module__}.{alloc_cls.__qualname__}",
        entry_points=[f"{ep.name} = {ep.value}" for ep in points],
    )
    if not points:
        problems.append(
            "no sglang.srt.plugins entry point of ulakv: SGLang's servers would never call install"
        )
    elif not any(ep.load() is install for ep in points):
        problems.append(f"the ulakv entry point ({points[0].value}) does not load install")
    if problems:
        raise Failed("; ".join(problems))
    return "coordinator, pool and allocator replaced; entry point registered"


# -- 4. kv pool round trip ---------------------------------------------------------------------------
def check_kv_pool_roundtrip(details: dict[str, Any]) -> str:
    _require_sglang()
    _require_cuda()
    import torch

    with _single_rank():
        pool_cls, _ = _installed_classes()
        size, mrr = 4096, 64
        ours = _our_pool(pool_cls, size, fp8=True, max_running_requests=mrr)
        ref = _reference_pool(size * RATIO, fp8=True, max_running_requests=mrr)
        store = ours.ulakv_store
        details.update(size=size, live_loc=size * RATIO, store=_store_config(store))

        # The layout SGLang's backends read: FP8 DSA rows, kv_buffer viewing the pool's paged rows.
        if not (ours.dsa_kv_cache_store_fp8 and ours.kv_cache_dim == FP8_ROW):
            raise Failed(
                "our pool is not SGLang's FP8 DSA layout: "
                f"dsa_kv_cache_store_fp8={ours.dsa_kv_cache_store_fp8}, kv_cache_dim={ours.kv_cache_dim} "
                f"(want True, {FP8_ROW})"
            )
        for layer in range(LAYERS):
            buf = ours.kv_buffer[layer]
            if buf.dtype != torch.uint8 or tuple(buf.shape[1:]) != (1, FP8_ROW) or buf.shape[0] % PAGE:
                raise Failed(
                    f"kv_buffer[{layer}] is {buf.dtype} {tuple(buf.shape)}: want uint8 [64 k, 1, 656]"
                )
            if buf.shape[0] <= size:
                raise Failed(f"kv_buffer[{layer}] has {buf.shape[0]} rows for {size} GPU slots and a dummy")
            if buf.data_ptr() != store.kv_rows(layer).data_ptr():
                raise Failed(f"kv_buffer[{layer}] is not a view of the ulakv pool's GPU rows")
            # data_ptrs is uint64 (MLATokenToKVPool.__init__): read it as int64, which CUDA indexes
            if ours.data_ptrs.view(torch.int64).tolist()[layer] != buf.data_ptr():
                raise Failed(f"data_ptrs[{layer}] does not point at kv_buffer[{layer}]")
            key = ours.get_key_buffer(layer)
            if key.dtype != torch.float8_e4m3fn or key.data_ptr() != buf.data_ptr():
                raise Failed(f"get_key_buffer({layer}) is {key.dtype}, not an fp8 view of kv_buffer[{layer}]")

        gen = torch.Generator(device=DEVICE).manual_seed(1)
        loc = (torch.randperm(size * RATIO + PAGE - 1, generator=torch.Generator().manual_seed(2)) + 1).to(
            DEVICE
        )
        first, later = loc[:1024], loc[1024 : 1024 + 5000]

        def write(locs: torch.Tensor, chunk: int, padding: bool) -> torch.Tensor:
            """Admit ``locs`` into ours, write random rows through ``set_mla_kv_buffer`` on both pools
            in calls of ``chunk`` (a ``loc`` 0 in the middle of each when ``padding``: a padded batch);
            returns each row's position in its call."""
            store.admit(locs)
            where = []
            for part in _chunks(locs, chunk):
                batch = part
                if padding:
                    half = part.numel() // 2
                    batch = torch.cat([part[:half], part.new_zeros(1), part[half:]])
                pos = torch.arange(batch.numel())
                where.append(pos[batch.cpu() != 0])
                for layer in range(LAYERS):
                    nope = torch.randn((batch.numel(), 1, KV_LORA_RANK), generator=gen, device=DEVICE)
                    rope = torch.randn((batch.numel(), 1, ROPE_DIM), generator=gen, device=DEVICE)
                    nope, rope = nope.to(torch.bfloat16), rope.to(torch.bfloat16)
                    ours.set_mla_kv_buffer(_layer(layer), batch, nope, rope)
                    ref.set_mla_kv_buffer(_layer(layer), batch, nope, rope)
            return torch.cat(where)

        def compare(what: str, sel: torch.Tensor, where: torch.Tensor) -> int:
            """Our rows of ``sel`` read through the store's slots against the reference's rows."""
            for layer in range(LAYERS):
                slots = store.slots(layer, sel.to(torch.int32).view(1, -1)).view(-1)
                if bool((slots < 0).any()):
                    raise Failed(f"{what}, layer {layer}: {int((slots < 0).sum())} live loc got slot -1")
                got = _byte_rows(ours.kv_buffer[layer])[slots.long()]
                want = _byte_rows(ref.kv_buffer[layer])[sel]
                bad = (got != want).any(dim=1)
                if bool(bad.any()):
                    raise Failed(_mismatch(f"{what}, layer {layer}", bad, where))
            return sel.numel() * LAYERS

        where_first = write(first, 256, padding=True)
        checked = compare("written", first, where_first)

        # More tokens than the GPU cache holds: a write past a full cache puts rows in CPU rows, so the
        # first tokens are evicted by selecting newer ones (4096 of them, filling the GPU) first.
        where_later = write(later, 500, padding=False)  # 6024 live > 4096 GPU slots
        for start in (0, 2048):
            part = slice(start, start + 2048)
            checked += compare("newer tokens selected", later[part], where_later[part])
        group0 = store.pool.config.group_of(0)
        on_cpu = int((store.pool.residency(group0, first) < 0).sum())
        details["first_rows_on_cpu_before_selection"] = on_cpu
        if on_cpu == 0:
            raise Failed("nothing of the first 1024 tokens was evicted: the check did not test eviction")
        before = store.pool.stats()
        sel = torch.cat([first, later[4096:]])  # the evicted first tokens and the never-selected rest
        checked += compare("after eviction", sel, torch.cat([where_first, where_later[4096:]]))
        after = store.pool.stats()
        details["misses_of_selection"] = after["misses"] - before["misses"]
        if after["misses"] <= before["misses"]:
            raise Failed("selecting evicted tokens brought nothing back from the CPU")
        store.pool.check()
        store.pool.check_invariants()
        details["rows_checked"] = checked
    return f"{checked} rows byte-equal to DSATokenToKVPool's, {on_cpu} of them read back from the CPU tier"


# -- 5 and 7. FlashMLA over our buffers ------------------------------------------------------------------
def _flashmla_sparse(
    q_all: torch.Tensor, kv_cache: torch.Tensor, page_table_1: torch.Tensor, sm_scale: float, topk_length: Any
) -> torch.Tensor:
    """``DeepseekSparseAttnBackend._forward_flashmla_sparse`` (dsa_backend.py) without the backend:
    heads padded to the kernel's multiple, ``indices = page_table_1.unsqueeze(1)``."""
    import torch
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

    num_tokens, num_heads, head_dim = q_all.shape
    required = 128 if torch.cuda.get_device_capability()[0] >= 10 else 64
    q_input = q_all
    if num_heads % required:
        q_input = q_all.new_zeros((num_tokens, required, head_dim))
        q_input[:, :num_heads, :] = q_all
    if topk_length is not None and topk_length.shape[0] != num_tokens:
        topk_length = None
    o, _, _ = flash_mla_sparse_fwd(
        q=q_input,
        kv=kv_cache,
        indices=page_table_1.unsqueeze(1),
        sm_scale=sm_scale,
        d_v=KV_LORA_RANK,
        attn_sink=None,
        topk_length=topk_length,
    )
    return o[:, :num_heads, :]


def _flashmla_kv(
    q_all: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table_1: torch.Tensor,
    sm_scale: float,
    cache_seqlens: Any,
) -> torch.Tensor:
    """``DeepseekSparseAttnBackend._forward_flashmla_kv`` with ``_compute_flashmla_metadata``
    (dsa_backend.py): FlashMLA's sparse decode over the FP8 cache viewed as 64-token pages."""
    import torch
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_with_kvcache, get_mla_metadata

    num_heads = q_all.shape[1]
    metadata, num_splits = get_mla_metadata(
        cache_seqlens=cache_seqlens,
        num_q_tokens_per_head_k=1 * num_heads // 1,
        num_heads_k=1,
        num_heads_q=num_heads,
        is_fp8_kvcache=True,
        topk=TOP_K,
    )
    q = q_all.view(-1, 1, num_heads, q_all.shape[-1])
    o, _ = flash_mla_with_kvcache(
        q=q,
        k_cache=kv_cache.view(-1, PAGE, 1, kv_cache.shape[-1]),
        cache_seqlens=cache_seqlens,
        head_dim_v=KV_LORA_RANK,
        tile_scheduler_metadata=metadata,
        num_splits=num_splits,
        softmax_scale=sm_scale,
        indices=page_table_1.unsqueeze(1),
        block_table=torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device),
        is_fp8_kvcache=True,
        kv_format="V32",
    )
    return o


def _attention_pair(fp8: bool, kernel: Callable[..., torch.Tensor], details: dict[str, Any]) -> str:
    """Both pools hold the same bytes; the kernel reads ours through the coordinator's slots and the
    reference through SGLang's plain page table; outputs must be bit-identical."""
    try:
        import flash_mla  # noqa: F401
    except ImportError as exc:
        raise Skip(f"flash_mla does not import ({exc})") from exc
    import torch
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode

    from ulakv.integrations.sglang import UlakvSparseCoordinator

    with _single_rank():
        pool_cls, _ = _installed_classes()
        size, mrr = 8192, 8
        ours = _our_pool(pool_cls, size, fp8=fp8, max_running_requests=mrr)
        ref = _reference_pool(size * RATIO, fp8=fp8, max_running_requests=mrr)
        store = ours.ulakv_store
        lens = [3000, 3000, 3000, 1500]  # the last shorter than top-k: -1 tail, topk_length 1500
        reqs = _make_requests(lens, {1: (0, 1000)}, size * RATIO + PAGE, max_reqs=mrr, context=3072, seed=3)
        details.update(size=size, lens=lens, heads=HEADS, store=_store_config(store))
        gen = torch.Generator(device=DEVICE).manual_seed(4)
        for part in _chunks(reqs.all_own().to(DEVICE), 2048):  # prefill chunks: SGLang's writer fills ref
            store.admit(part)
            for layer in range(LAYERS):
                nope = torch.randn((part.numel(), 1, KV_LORA_RANK), generator=gen, device=DEVICE)
                rope = torch.randn((part.numel(), 1, ROPE_DIM), generator=gen, device=DEVICE)
                ref.set_mla_kv_buffer(_layer(layer), part, nope.to(torch.bfloat16), rope.to(torch.bfloat16))
                store.write(layer, part, _byte_rows(ref.kv_buffer[layer])[part])
        coord = UlakvSparseCoordinator.from_store(
            store, reqs.req_to_token, TOP_K, transform_index_page_table_decode
        )
        B = len(lens)
        rpi = torch.tensor(reqs.rows, dtype=torch.int64, device=DEVICE)
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
        topk = _topk(lens, pad_rows=0, seed=5)
        coord.num_real_reqs.fill_(B)
        # dsa_cache_seqlens_int32: seq_lens clipped to the index top-k (compute_dsa_seqlens)
        topk_length = seq_lens.clamp(max=TOP_K).to(torch.int32)
        q = (torch.randn((B, HEADS, KV_LORA_RANK + ROPE_DIM), generator=gen, device=DEVICE) * 0.5).to(
            torch.bfloat16
        )
        sm_scale = (KV_LORA_RANK + ROPE_DIM) ** -0.5
        for layer in range(LAYERS):
            ours_pt = coord.swap_in_selected_pages(rpi, seq_lens, topk, layer)
            # SGLang's path without HiSparse (forward_decode): the request rows of req_to_token
            ref_pt = transform_index_page_table_decode(
                page_table=reqs.req_to_token.index_select(0, rpi), topk_indices=topk, page_size=1
            )
            if not torch.equal(ours_pt >= 0, ref_pt >= 0):
                raise Failed(f"layer {layer}: our slots and SGLang's page table pad different entries")
            valid = ref_pt >= 0
            got = _byte_rows(ours.kv_buffer[layer])[ours_pt[valid].long()]
            want = _byte_rows(ref.kv_buffer[layer])[ref_pt[valid].long()]
            bad = (got != want).any(dim=1)
            if bool(bad.any()):
                raise Failed(_mismatch(f"layer {layer}, rows under the slots before FlashMLA", bad))
            o_ref = kernel(q, ref.get_key_buffer(layer), ref_pt, sm_scale, topk_length)
            o_ours = kernel(q, ours.get_key_buffer(layer), ours_pt, sm_scale, topk_length)
            _sync()
            if not bool(torch.isfinite(o_ref).all()):
                raise Failed(f"layer {layer}: the reference output is not finite (the check's inputs?)")
            if not torch.equal(o_ours, o_ref):
                diff = (o_ours.float() - o_ref.float()).abs()
                raise Failed(
                    f"layer {layer}: outputs differ in {int((diff != 0).sum())} of {diff.numel()} values "
                    f"(max abs diff {float(diff.max()):.3g})"
                )
        details["output_shape"] = list(o_ours.shape)
        store.pool.check()
    return f"{B} requests x {LAYERS} layers, top-k {TOP_K}: outputs bit-identical to SGLang's own path"


def check_flashmla_sparse_decode(details: dict[str, Any]) -> str:
    _require_sglang()
    _require_cuda()
    return _attention_pair(fp8=False, kernel=_flashmla_sparse, details=details)


def check_flashmla_kv_decode(details: dict[str, Any]) -> str:
    _require_sglang()
    _require_cuda()
    return _attention_pair(fp8=True, kernel=_flashmla_kv, details=details)


# -- 6 and 8. coordinator decode, eager and captured -----------------------------------------------------
class DecodeBatch:
    """A decode batch on the replaced FP8 pool: 8 requests of 3000 tokens (1 and 2 share request 0's
    first 1024, 5 shares request 4's first 2000) padded to 10 like a captured batch, their rows written
    through the store (random bytes, kept in ``truth``: the writer is check 4's), and the coordinator
    over SGLang's ``ReqToTokenPool`` with SGLang's transform."""

    size, mrr, real, padded, context = 16384, 16, 8, 10, 3072
    shares: ClassVar[dict[int, tuple[int, int]]] = {1: (0, 1024), 2: (0, 1024), 5: (4, 2000)}

    def __init__(self, details: dict[str, Any]) -> None:
        import torch
        from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode

        from ulakv.integrations.sglang import UlakvSparseCoordinator

        pool_cls, _ = _installed_classes()
        self.pool = _our_pool(pool_cls, self.size, fp8=True, max_running_requests=self.mrr)
        self.store = store = self.pool.ulakv_store
        if store.kv.max_batch < self.padded:
            raise Failed(
                f"the store's max_batch is {store.kv.max_batch} (ULAKV_SGLANG_MAX_BATCH?): need {self.padded}"
            )
        loc_space = self.size * RATIO + PAGE
        lens = [3000] * self.real
        self.reqs = _make_requests(lens, self.shares, loc_space, self.mrr, self.context, seed=6)
        own = self.reqs.all_own()
        details.update(
            size=self.size,
            requests=self.real,
            padded_batch=self.padded,
            distinct_tokens=own.numel(),
            store=_store_config(store),
        )
        self.truth = torch.randint(
            0, 256, (LAYERS, loc_space, FP8_ROW), dtype=torch.uint8, device=DEVICE,
            generator=torch.Generator(device=DEVICE).manual_seed(7),
        )  # fmt: skip
        for part in _chunks(own.to(DEVICE), 4096):  # prefill chunks; 19952 tokens > 16384 GPU slots: evicts
            store.admit(part)
            for layer in range(LAYERS):
                store.write(layer, part, self.truth[layer, part])
        self.coord = UlakvSparseCoordinator.from_store(
            store, self.reqs.req_to_token, TOP_K, transform_index_page_table_decode
        )
        pad = self.padded - self.real
        self.rpi = torch.tensor([*self.reqs.rows, *[0] * pad], dtype=torch.int64, device=DEVICE)
        self.seq_lens = torch.tensor([*lens, *[1] * pad], dtype=torch.int64, device=DEVICE)  # SGLang pads 1
        self.topk = _topk(lens, pad_rows=pad, seed=8, holes=37)
        self.kv_rows = [_byte_rows(self.pool.kv_buffer[layer]) for layer in range(LAYERS)]
        # As SGLang's model runner and cuda-graph runner do before a forward or a replay.
        self.coord.num_real_reqs.fill_(self.real)

    def new_topk(self, seed: int, newest: bool = False) -> None:
        """New top-k written into the (captured) input buffer."""
        lens = self.seq_lens[: self.real].tolist()
        self.topk.copy_(_topk(lens, pad_rows=self.padded - self.real, seed=seed, holes=37, newest=newest))

    def swap_in(self) -> list[torch.Tensor]:
        return [
            self.coord.swap_in_selected_pages(self.rpi, self.seq_lens, self.topk, layer)
            for layer in range(LAYERS)
        ]

    def verify(self, what: str, slots_by_layer: list[torch.Tensor]) -> int:
        """Each layer's slots: -1 for padding requests and padded positions, else the slot whose row
        in ``kv_buffer`` is the one written for the position's ``loc``. Returns the rows checked."""
        import torch

        real, topk = self.real, self.topk
        for layer, slots in enumerate(slots_by_layer):
            if slots.dtype != torch.int32 or slots.shape != topk.shape:
                raise Failed(f"{what}, layer {layer}: slots are {slots.dtype} {tuple(slots.shape)}")
            if bool((slots[real:] != -1).any()):
                raise Failed(f"{what}, layer {layer}: a padding request (past num_real_reqs) got slots")
            pos, got_slots = topk[:real], slots[:real]
            valid = pos >= 0
            if not torch.equal(got_slots >= 0, valid):
                raise Failed(f"{what}, layer {layer}: slots are not -1 exactly where positions are")
            locs = self.reqs.req_to_token.index_select(0, self.rpi[:real]).gather(1, pos.clamp(min=0).long())
            got = self.kv_rows[layer][got_slots[valid].long()]
            want = self.truth[layer][locs[valid].long()]
            bad = (got != want).any(dim=1)
            if bool(bad.any()):
                raise Failed(_mismatch(f"{what}, layer {layer}", bad))
        return int((topk[:real] >= 0).sum()) * LAYERS


def check_coordinator_decode(details: dict[str, Any]) -> str:
    _require_sglang()
    _require_cuda()

    with _single_rank():
        batch = DecodeBatch(details)
        store = batch.store
        before = store.pool.stats()
        checked = batch.verify("eager", batch.swap_in())
        details["eager_misses"] = store.pool.stats()["misses"] - before["misses"]
        store.pool.check()
        # SGLang zeroes a padded batch's req_pool_indices (INDEX_SEMANTIC_BUFFERS, input_buffers.py), so
        # padding reaches loc 0; num_real_reqs is the second guard: padding rows naming real requests.
        batch.rpi[batch.real :] = batch.rpi[: batch.padded - batch.real]
        checked += batch.verify("eager, padding rows naming real requests", batch.swap_in())
        batch.rpi[batch.real :] = 0
        store.pool.check()

        # Captured after a warm-up, replayed on new top-k written into the captured input buffer.
        batch.swap_in()
        _sync()

        def step() -> list[torch.Tensor]:
            slots = batch.swap_in()
            store.kv.join()  # the end of a captured step (SparseKV's contract)
            return slots

        captured, replay_graph = _capture(step)
        for replay in range(3):
            batch.new_topk(seed=100 + replay)
            batch.coord.num_real_reqs.fill_(batch.real)
            replay_graph()
            _sync()
            store.pool.check()  # a refusal recorded during the replay raises here
            checked += batch.verify(f"graph replay {replay}", captured)
        del replay_graph
        store.pool.check_invariants()
        stats = store.pool.stats()
        details.update(rows_checked=checked, misses=stats["misses"], victims=stats["victims"])
    return f"{checked} rows read back right: one eager step, 3 replays of the captured step on new top-k"


def check_decode_step_graph(details: dict[str, Any]) -> str:
    """A whole decode step captured as SGLang's decode graph holds it: per layer, the new tokens' rows
    written (``forward_decode`` writes before it reads), then the swap-in. The scheduler's part (new
    ``loc`` made live by the allocator, ``req_to_token``, ``seq_lens``) stays outside the graph."""
    _require_sglang()
    _require_cuda()
    import torch

    with _single_rank():
        batch = DecodeBatch(details)
        store, real = batch.store, batch.real
        out_loc = torch.zeros(batch.padded, dtype=torch.int64, device=DEVICE)  # padding requests: loc 0
        new_rows = torch.zeros((LAYERS, batch.padded, FP8_ROW), dtype=torch.uint8, device=DEVICE)
        row_gen = torch.Generator(device=DEVICE).manual_seed(9)

        def decode_step() -> list[torch.Tensor]:
            slots = []
            for layer in range(LAYERS):
                store.write(layer, out_loc, new_rows[layer])
                slots.append(batch.coord.swap_in_selected_pages(batch.rpi, batch.seq_lens, batch.topk, layer))
            store.kv.join()
            return slots

        def next_token(step: int) -> None:
            new = batch.reqs.take(real).to(DEVICE)
            store.admit(new)
            out_loc[:real] = new
            cols = batch.seq_lens[:real].clone()
            batch.reqs.req_to_token[batch.rpi[:real], cols] = new.to(torch.int32)
            batch.seq_lens[:real] += 1
            rows = torch.randint(0, 256, new_rows.shape, dtype=torch.uint8, device=DEVICE, generator=row_gen)
            new_rows.copy_(rows)
            batch.truth[:, new] = new_rows[:, :real]
            batch.new_topk(seed=200 + step, newest=True)  # each request reads its newest token too
            batch.coord.num_real_reqs.fill_(real)

        next_token(0)
        checked = batch.verify("eager step", decode_step())  # also the warm-up
        store.pool.check()
        _sync()
        captured, replay_graph = _capture(decode_step)
        for replay in range(3):
            next_token(1 + replay)
            replay_graph()
            _sync()
            store.pool.check()
            checked += batch.verify(f"graph replay {replay}", captured)
        del replay_graph
        store.pool.check_invariants()
        details["rows_checked"] = checked
    return (
        f"{checked} rows read back right, new tokens' included: one eager step, 3 replays of the captured one"
    )


# -- 9. allocator --------------------------------------------------------------------------------------
def check_allocator(details: dict[str, Any]) -> str:
    _require_sglang()
    _require_cuda()
    import torch

    with _single_rank():
        pool_cls, alloc_cls = _installed_classes()
        size = 4096
        pool = _our_pool(pool_cls, size, fp8=True, max_running_requests=64)
        # As kv_cache_configurator builds HiSparse's allocator (size positional, the rest by keyword).
        alloc = alloc_cls(
            size,
            page_size=PAGE,
            dtype=torch.float8_e4m3fn,
            device=DEVICE,
            kvcache=pool,
            need_sort=False,
            host_to_device_ratio=RATIO,
        )
        store = pool.ulakv_store
        full = size * RATIO

        def live() -> list[int]:
            return store.pool.live_addresses().tolist()

        if alloc.get_kvcache() is not pool or alloc.size_full != full or alloc.available_size() != full:
            raise Failed(
                f"a fresh allocator: size_full {alloc.size_full}, available {alloc.available_size()} "
                f"(want {full} and {full})"
            )
        a, b = alloc.alloc(640), alloc.alloc(5120)
        if a is None or b is None:
            raise Failed("alloc returned None with room to spare")
        if live() != sorted(torch.cat([a, b]).tolist()):
            raise Failed("the pool's live loc are not exactly the allocated ones")
        gen = torch.Generator(device=DEVICE).manual_seed(10)
        for part in _chunks(torch.cat([a, b]), 2048):  # 5760 tokens > 4096 GPU slots: some to the CPU
            for layer in range(LAYERS):
                rows = torch.randint(
                    0, 256, (part.numel(), FP8_ROW), dtype=torch.uint8, device=DEVICE, generator=gen
                )
                store.write(layer, part, rows)
        alloc.free(a)
        stats = store.pool.stats()
        if live() != sorted(b.tolist()) or alloc.available_size() != full - b.numel():
            raise Failed("after free: the pool's live loc or the allocator's free count are wrong")
        if stats["gpu_slots_used"] + stats["cpu_slots_used"] != LAYERS * b.numel():
            raise Failed(f"after free: {stats['gpu_slots_used']} + {stats['cpu_slots_used']} homes used")
        if alloc.alloc(full) is not None or live() != sorted(b.tolist()):
            raise Failed("an allocation larger than what is free did not return None, or changed the pool")
        store.pool.check_invariants()
        alloc.clear()
        if live() or alloc.available_size() != full:
            raise Failed("clear left loc live in the pool or the allocator not empty")
        details.update(size=size, allocated=[a.numel(), b.numel()], homes_after_free=LAYERS * b.numel())
    return "alloc makes exactly its loc live, free releases them with their homes, clear empties both"


# -- 10. DCP hooks ------------------------------------------------------------------------------------------
DCP = 4  # the simulated DCP group: its ranks' pools in this one process, on this one GPU


@contextlib.contextmanager
def _dcp_rank(rank: int) -> Iterator[None]:
    """SGLang's parallel context as rank ``rank`` of a DCP group of ``DCP`` sees it."""
    from sglang.srt.runtime_context import get_parallel

    with _single_rank(), get_parallel().override(attn_dcp_size=DCP, attn_dcp_rank=rank, dcp_enabled=True):
        yield


def check_dcp_hooks(details: dict[str, Any]) -> str:
    _require_sglang()
    from types import SimpleNamespace as Cfg

    from ulakv.integrations.sglang import dcp_hooks

    _installed_classes()  # install() and apply_hooks(), once
    problems = []
    dsa_dcp = importlib.import_module("sglang.srt.layers.attention.dsa.dsa_dcp")
    backend = importlib.import_module("sglang.srt.layers.attention.dsa_backend")
    overrides = importlib.import_module("sglang.srt.arg_groups.model_overrides.deepseek_v2")
    for module, name in ((dsa_dcp, "localize_dcp_page_table"), (backend, "localize_dcp_page_table")):
        if getattr(getattr(module, name), "__wrapped__", None) is None:
            problems.append(f"{module.__name__}.{name} is not wrapped (the hook did not apply or propagate)")
    cls = backend.DeepseekSparseAttnBackend
    for name in ("__init__", "_forward_trtllm"):
        if getattr(getattr(cls, name), "__wrapped__", None) is None:
            problems.append(f"DeepseekSparseAttnBackend.{name} is not wrapped")
    cfg = dict(
        dcp_size=DCP,
        enable_hisparse=True,
        enable_hierarchical_cache=False,
        disaggregation_mode="null",
        speculative_eagle_topk=None,
        dsa_prefill_backend=None,
        dsa_decode_backend=None,
        dcp_replicate_q_proj=None,
        dcp_comm_backend="ag_rs",
    )
    got = overrides._dsa_dcp_overrides(Cfg(**cfg))
    if got.get("dsa_decode_backend") != dcp_hooks.DCP_BACKEND:
        problems.append(f"_dsa_dcp_overrides under the hook gave {got}, not the trtllm backends")
    try:
        overrides._dsa_dcp_overrides(Cfg(**{**cfg, "dsa_decode_backend": "flashmla_sparse"}))
        problems.append("--dsa-decode-backend flashmla_sparse under DCP was not refused")
    except dcp_hooks.UnsupportedBySGLangAdapter:
        pass
    details.update(overrides=got)
    if problems:
        raise Failed("; ".join(problems))
    return "refusal lifted (trtllm declared), localisation and backend hooks applied and propagated"


# -- 11. DCP localisation -----------------------------------------------------------------------------------
def check_dcp_localize(details: dict[str, Any]) -> str:
    """Each rank of a simulated DCP group builds the replaced pool (SGLang's DSA base, its DCP row
    writer), writes every token's rows, and localises a decode page table through SGLang's hooked
    ``localize_dcp_page_table``; the rows read through each rank's block table equal, in order, those
    SGLang's ``transform_index_page_table_dcp`` selects from a dense pool (``loc`` s at row s), with
    its counts; the decode localisation replays in a CUDA graph."""
    _require_sglang()
    _require_cuda()
    import torch
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_dcp

    from ulakv.integrations.sglang import dcp_hooks

    pool_cls, _ = _installed_classes()
    dsa_dcp = importlib.import_module("sglang.srt.layers.attention.dsa.dsa_dcp")
    size, mrr, rows_n = 1024, 64, 48
    with _single_rank():
        ref = _reference_pool((size * RATIO + PAGE) * DCP, fp8=True, max_running_requests=mrr)
    space = (size * RATIO + PAGE) * DCP
    gen = torch.Generator().manual_seed(11)
    loc = (torch.randperm(space - PAGE * DCP, generator=gen) + PAGE * DCP)[: size * DCP].to(DEVICE)
    nope = torch.randn((loc.numel(), 1, KV_LORA_RANK), dtype=torch.bfloat16, device=DEVICE)
    rope = torch.randn((loc.numel(), 1, ROPE_DIM), dtype=torch.bfloat16, device=DEVICE)
    with _single_rank():
        for layer in range(LAYERS):
            ref.set_mla_kv_buffer(_layer(layer), loc, nope, rope)
    page_table = loc[torch.randint(0, loc.numel(), (rows_n, TOP_K), generator=gen).to(DEVICE)].to(torch.int32)
    page_table[rows_n - 4 :] = 0  # a captured batch's padding requests select loc 0
    page_table[3, TOP_K // 2 :] = -1
    checked = 0
    for rank in range(DCP):
        with _dcp_rank(rank):
            ours = _our_pool(pool_cls, size, fp8=True, max_running_requests=mrr)
            store = ours.ulakv_store
            if not isinstance(store, dcp_hooks.SGLangDcpStore):
                raise Failed(f"rank {rank}: the pool under --dcp-size {DCP} built {type(store).__name__}")
            store.admit(loc)
            for layer in range(LAYERS):
                for part, a, b in zip(
                    _chunks(loc, 2048), _chunks(nope, 2048), _chunks(rope, 2048), strict=True
                ):
                    ours.set_mla_kv_buffer(_layer(layer), part, a, b)
            cache = dcp_hooks.UlakvDcpPageTable(store)
            metadata = object()
            want_rows, want_counts = transform_index_page_table_dcp(
                torch.where(page_table == 0, -1, page_table), DCP, rank
            )
            for layer in range(LAYERS):
                table, counts = dsa_dcp.localize_dcp_page_table(
                    cache,
                    metadata=metadata,
                    layer_id=layer,
                    topk_indices=page_table,
                    page_table=page_table,
                    dcp_size=DCP,
                    dcp_rank=rank,
                )
                if not torch.equal(counts, want_counts):
                    raise Failed(f"rank {rank} layer {layer}: counts differ from SGLang's")
                keep = torch.arange(TOP_K, device=DEVICE) < counts[:, None]
                got = _byte_rows(ours.kv_buffer[layer])[table.clamp(min=0).long()]
                dense = want_rows.long() * DCP + rank  # SGLang's local row -> the loc it holds
                want = _byte_rows(ref.kv_buffer[layer])[dense.clamp(min=0)]
                bad = (got != want).any(-1) & keep
                if bad.any():
                    raise Failed(_mismatch(f"rank {rank} layer {layer}", bad))
                checked += int(keep.sum())

            def step(cache: Any = cache, rank: int = rank) -> list[torch.Tensor]:
                return list(
                    dsa_dcp.localize_dcp_page_table(
                        cache,
                        metadata=object(),
                        layer_id=0,
                        topk_indices=page_table,
                        page_table=page_table,
                        dcp_size=DCP,
                        dcp_rank=rank,
                    )
                )

            step()
            _sync()
            (table, counts), replay = _capture(step)
            replay()
            _sync()
            if not torch.equal(counts, want_counts):
                raise Failed(f"rank {rank}: a replayed localisation's counts differ from SGLang's")
            store.pool.check()
    details.update(dcp=DCP, size=size, rows=rows_n, top_k=TOP_K, rows_compared=checked)
    return (
        f"{DCP} ranks: {checked} rows through ulakv's slots equal SGLang's DCP rows, in order; graph replays"
    )


# -- the run -------------------------------------------------------------------------------------------------
CHECKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "version": check_version,
    "conformance": check_conformance,
    "install": check_install,
    "kv_pool_roundtrip": check_kv_pool_roundtrip,
    "flashmla_sparse_decode": check_flashmla_sparse_decode,
    "coordinator_decode": check_coordinator_decode,
    "flashmla_kv_decode": check_flashmla_kv_decode,
    "decode_step_graph": check_decode_step_graph,
    "allocator": check_allocator,
    "dcp_hooks": check_dcp_hooks,
    "dcp_localize": check_dcp_localize,
}


def run_check(name: str) -> SectionResult:
    """Run one check (``gpu_harness.run_section``), then free what it left on the device."""
    result, _ = run_section(name, CHECKS[name])
    _release_memory()
    return result


def _release_memory() -> None:
    """Free what a check left on the device before the next one (its pools are garbage by now)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        with contextlib.suppress(Exception):  # after a device fault nothing more can be done here
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def meta(argv: list[str]) -> dict[str, Any]:
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "command": " ".join(["python", "benchmarks/sglang_gpu_check.py", *argv]),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({platform.machine()})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sglang": _sglang_version(),
        "sglang_pinned": _pinned(),
        "flash_mla": _dist_version("sgl-flash-mla", "flash-mla", "flash_mla"),
        "sgl_kernel": _dist_version("sgl-kernel", "sgl_kernel"),
    }


def markdown(info: dict[str, Any], results: list[SectionResult], seconds: float) -> str:
    """The section to paste into benchmarks/RESULTS.md."""
    lines = [
        "## SGLang adapter on a GPU (`benchmarks/sglang_gpu_check.py`)",
        "",
        f"Date {info['date'][:10]}, commit {info['commit']}, {info['device']}, sglang {info['sglang']}, "
        f"flash-mla {info['flash_mla']}, sgl-kernel {info['sgl_kernel']}, torch {info['torch']}, command",
        f"`{info['command']}` ({seconds:.0f} s).",
        "",
        *result_rows(results),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the checks asked for, in suite order; 1 if any failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="python benchmarks/sglang_gpu_check.py",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="checks, in order: " + ", ".join(CHECKS),
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument(
        "--only",
        "--checks",
        dest="only",
        type=section_names(list(CHECKS)),
        default=None,
        help="comma-separated subset of the checks (default: all); they run in suite order",
    )
    args = parser.parse_args(argv)
    wanted = in_suite_order(args.only, list(CHECKS))
    started = time.perf_counter()
    results = []
    for name in wanted:
        result = run_check(name)
        results.append(result)
        print(f"{result.status:<4}  {name:<24} {result.seconds:8.2f} s  {result.reason}", flush=True)
        if result.error:
            print("      " + result.error.rstrip().replace("\n", "\n      "), flush=True)
    seconds = time.perf_counter() - started
    counts = Counter(r.status for r in results)
    info = meta(argv)
    summary = {
        "meta": info,
        "seconds": round(seconds, 3),
        "counts": {s: counts.get(s, 0) for s in ("PASS", "FAIL", "SKIP")},
        "ok": counts.get("FAIL", 0) == 0,
        "checks": [asdict(r) for r in results],
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(
        f"\n{counts.get('PASS', 0)} passed, {counts.get('FAIL', 0)} failed, {counts.get('SKIP', 0)} skipped "
        f"in {seconds:.1f} s" + (f"; results in {args.out}" if args.out is not None else "")
    )
    print("\nFor benchmarks/RESULTS.md:\n")
    print(markdown(info, results, seconds))
    return 1 if counts.get("FAIL", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
