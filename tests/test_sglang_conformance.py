"""The SGLang adapter's drop-ins against the pinned SGLang release's own source.

Three parts: the wheel cache (``tools/sglang_wheel.py``); the extractor
(``tools/sglang_conformance.py``) on the real wheel, on SGLang's own classes (which must conform to
their own usage) and on a tiny synthetic source tree; and the real check, our three classes against
SGLang's usage and class bodies, plus a proof that the check bites (a method removed from our class
is reported). The wheel is downloaded on first use into ``.cache/`` (``make test`` fetches it
beforehand); a failed download fails the tests, it does not skip them.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tools import sglang_conformance as conformance
from tools import sglang_wheel as wheel
from tools.sglang_conformance import (
    ALLOCATOR_CLASS,
    COORDINATOR_CLASS,
    POOL_CLASS,
    ApiMember,
    CallShape,
    Usage,
    class_api,
    coordinator_usage,
    problems,
)

INIT_KEYWORDS = {
    "req_to_token_pool",
    "token_to_kv_pool_allocator",
    "top_k",
    "device_buffer_size",
    "device",
    "tp_group",
    "host_to_device_ratio",
    "swap_in_block_size",
    "shared_index_layers",
    "num_draft_tokens",
}


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    """The pinned wheel's extracted source (downloaded into the cache on first use)."""
    try:
        return wheel.wheel_source()
    except RuntimeError as exc:
        pytest.fail(f"the SGLang {wheel.SGLANG_VERSION} wheel is needed and could not be fetched:\n{exc}")


@pytest.fixture(scope="session")
def usage(sglang_source: Path) -> dict[str, Usage]:
    return coordinator_usage(sglang_source)


# --------------------------------------------------------------------------------------------------------
# Helpers


def _without(cls: type, name: str) -> type:
    """A copy of ``cls`` lacking ``name`` (flattening the MRO when ``cls`` inherits it)."""
    skip = {name, "__dict__", "__weakref__"}
    if name in vars(cls):
        ns = {k: v for k, v in vars(cls).items() if k not in skip}
        return type(cls.__name__, cls.__bases__, ns)
    ns: dict[str, object] = {}
    annotations: dict[str, object] = {}
    for klass in reversed(cls.__mro__[:-1]):
        ns.update({k: v for k, v in vars(klass).items() if k not in skip})
        annotations.update(inspect.get_annotations(klass))
    annotations.pop(name, None)
    ns["__annotations__"] = annotations
    return type(cls.__name__, (object,), ns)


def _stub_member(member: ApiMember) -> object:
    """A do-nothing callable (or property) with the SGLang member's exact signature."""
    if member.kind == "property":
        return property(lambda self: None)
    scope: dict[str, object] = {}
    exec(f"def {member.name}{member.signature()}: pass", scope)
    func = scope[member.name]
    if member.kind == "staticmethod":
        return staticmethod(func)
    if member.kind == "classmethod":
        return classmethod(func)
    return func


def _self_attributes(source: Path, module: str, class_name: str) -> set[str]:
    """Names a class's methods assign as ``self.NAME`` (its instance attributes)."""
    tree = ast.parse((source / module).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }


def _sglang_stub(source: Path, module: str, class_name: str) -> type:
    """SGLang's own class, rebuilt from its source: its methods' signatures and its instance attributes."""
    api = class_api(source, module, class_name)
    ns: dict[str, object] = {name: _stub_member(m) for name, m in api.items()}
    ns["__annotations__"] = dict.fromkeys(_self_attributes(source, module, class_name) - set(api), "object")
    return type(class_name, (object,), ns)


# --------------------------------------------------------------------------------------------------------
# The wheel cache


def test_wheel_source_layout(sglang_source: Path) -> None:
    assert (sglang_source / ".ready").is_file()
    for module, _ in (COORDINATOR_CLASS, POOL_CLASS, ALLOCATOR_CLASS):
        assert (sglang_source / module).is_file(), module
    assert not list(sglang_source.glob("*.whl")), "the wheel itself is not kept"
    assert not [p for p in (sglang_source / "sglang").rglob("*") if p.is_file() and p.suffix != ".py"]
    t0 = time.perf_counter()
    assert wheel.wheel_source() == sglang_source
    assert time.perf_counter() - t0 < 1.0, "a ready cache is returned without fetching"


def test_wheel_source_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ULAKV_SGLANG_CACHE", str(tmp_path / "elsewhere"))
    assert wheel.default_cache() == tmp_path / "elsewhere"


def test_wheel_download_failure_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    failing = [sys.executable, "-c", "import sys; print('no index here'); sys.exit(3)"]
    monkeypatch.setattr(wheel, "_pip_command", lambda dest: failing)
    with pytest.raises(RuntimeError) as info:
        wheel.wheel_source(tmp_path / "cache")
    message = str(info.value)
    assert "exit code 3" in message and "no index here" in message and sys.executable in message
    assert not (tmp_path / "cache").exists(), "a failed fetch leaves no half cache behind"


def test_load_transform_index(sglang_source: Path) -> None:
    module = wheel.load_transform_index(sglang_source)
    assert callable(module.transform_index_page_table_decode)
    assert callable(module.transform_index_page_table_prefill)
    assert wheel.load_transform_index(sglang_source) is module


# --------------------------------------------------------------------------------------------------------
# The extractor on the real wheel


def test_usage_swap_in_selected_pages(usage: dict[str, Usage]) -> None:
    u = usage["swap_in_selected_pages"]
    dsa = [c for c in u.calls if c.where.startswith("sglang/srt/layers/attention/dsa_backend.py:")]
    assert len(dsa) >= 2 and all(c.n_positional == 4 and c.keywords == () for c in dsa)
    assert "sglang/srt/layers/attention/dsa_backend.py" in u.files


def test_usage_core_members(usage: dict[str, Usage]) -> None:
    assert {"request_finished", "num_real_reqs", "map_last_loc_to_buffer", "__init__"} <= set(usage)
    assert {(c.n_positional, c.keywords) for c in usage["request_finished"].calls} == {(1, ())}
    assert "num_real_reqs.fill_()" in usage["num_real_reqs"].chains
    assert not usage["num_real_reqs"].calls
    (mapping,) = usage["map_last_loc_to_buffer"].calls
    assert mapping.n_positional == 5 and mapping.where.startswith("sglang/srt/managers/schedule_batch.py:")


def test_usage_constructor(usage: dict[str, Usage]) -> None:
    (ctor,) = usage["__init__"].calls
    assert ctor.where.startswith("sglang/srt/model_executor/model_runner.py:")
    assert ctor.n_positional == 0 and set(ctor.keywords) == INIT_KEYWORDS


def test_usage_follows_aliases_and_parameters(usage: dict[str, Usage]) -> None:
    # `coordinator = self.scheduler.hisparse_coordinator` then `coordinator.padded_buffer_size` (decode.py)
    assert usage["padded_buffer_size"].files == ["sglang/srt/disaggregation/decode.py"]
    assert "host_token_len" in usage
    # a `hisparse_coordinator: Optional[HiSparseCoordinator]` parameter (schedule_batch.release_req)
    assert usage["retract_req"].files == ["sglang/srt/managers/schedule_batch.py"]


def test_usage_members_exist_on_sglangs_own_coordinator(sglang_source: Path, usage: dict[str, Usage]) -> None:
    """The extractor finds real members only: each is a method or instance attribute of SGLang's class."""
    api = class_api(sglang_source, *COORDINATOR_CLASS)
    attributes = _self_attributes(sglang_source, *COORDINATOR_CLASS)
    assert set(usage) <= set(api) | attributes


def test_sglangs_own_classes_conform(sglang_source: Path, usage: dict[str, Usage]) -> None:
    """The checker accepts SGLang's own classes (rebuilt from their source) against their own usage."""
    coordinator = _sglang_stub(sglang_source, *COORDINATOR_CLASS)
    assert problems(coordinator, usage) == []
    for module, name in (POOL_CLASS, ALLOCATOR_CLASS):
        assert (
            problems(_sglang_stub(sglang_source, module, name), class_api(sglang_source, module, name)) == []
        )


def test_class_api_of_the_pool_and_allocator(sglang_source: Path) -> None:
    pool = class_api(sglang_source, *POOL_CLASS)
    assert {"__init__", "set_mla_kv_buffer", "translate_loc_to_hisparse_device", "register_mapping"} <= set(
        pool
    )
    assert [p.name for p in pool["set_mla_kv_buffer"].params] == [
        "self",
        "layer",
        "loc_info",
        "cache_k_nope",
        "cache_k_rope",
    ]
    alloc = class_api(
        sglang_source, ALLOCATOR_CLASS[0].replace("/", ".").removesuffix(".py"), ALLOCATOR_CLASS[1]
    )
    assert alloc["size"].kind == "property" and alloc["free"].kind == "method"
    kinds = {p.name: (p.kind, p.has_default) for p in alloc["configure_spec_scratch"].params}
    assert kinds["device_buffer_size"] == (inspect.Parameter.KEYWORD_ONLY, True)


def test_cli_prints_tables(sglang_source: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = conformance.main(["--source", str(sglang_source)])
    out = capsys.readouterr().out
    assert "swap_in_selected_pages" in out and "HiSparseTokenToKVPoolAllocator" in out
    assert rc in (0, 1) and ("0 problem(s)" in out) == (rc == 0)


# --------------------------------------------------------------------------------------------------------
# The extractor and the checker on a synthetic source tree

_SYNTHETIC = """
from typing import Optional

class Runner:
    def init(self):
        self.hisparse_coordinator = HiSparseCoordinator(self.pool, top_k=2048)

    def step(self, batch):
        self.hisparse_coordinator.num_real_reqs.fill_(3)
        coord = self.hisparse_coordinator
        alias = coord
        alias.swap_in_selected_pages(batch.a, batch.b, batch.c, layer_id=0)
        coord.mem_pool_host.alloc_slots(1)
        coord.flag = True
        coord.finish(*batch.reqs)
        getattr(self, "hisparse_coordinator", None).destroy()


def release(req, hisparse_coordinator):
    hisparse_coordinator.retract_req(req)


def other(req, c: Optional["HiSparseCoordinator"]):
    c.request_finished(req)


def unrelated(coord):
    coord.not_the_coordinator()
"""


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    (tmp_path / "sglang" / "srt").mkdir(parents=True)
    (tmp_path / "sglang" / "srt" / "runner.py").write_text(textwrap.dedent(_SYNTHETIC))
    (tmp_path / "sglang" / "srt" / "pool.py").write_text(
        textwrap.dedent(
            """
            class Pool:
                def __init__(self, size, page_size, device="cpu"):
                    pass

                def write(self, layer, loc, *, dst_dtype=None):
                    pass

                @property
                def size(self):
                    return 0

                @staticmethod
                def helper(x):
                    return x
            """
        )
    )
    return tmp_path


class _Conforming:
    num_real_reqs: object
    mem_pool_host: object
    flag: bool

    def __init__(self, pool, *, top_k: int) -> None:
        pass

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, topk, layer_id):
        pass

    def finish(self, *reqs):
        pass

    def destroy(self):
        pass

    def retract_req(self, req):
        pass

    def request_finished(self, req):
        pass


def test_synthetic_usage(synthetic: Path) -> None:
    usage = coordinator_usage(synthetic)
    assert set(usage) == {
        "__init__",
        "num_real_reqs",
        "swap_in_selected_pages",
        "mem_pool_host",
        "flag",
        "finish",
        "destroy",
        "retract_req",
        "request_finished",
    }
    (swap,) = usage["swap_in_selected_pages"].calls
    assert (swap.n_positional, swap.keywords) == (3, ("layer_id",))
    assert swap.where == "sglang/srt/runner.py:12"
    assert usage["__init__"].calls == [CallShape(1, ("top_k",), "sglang/srt/runner.py:6")]
    assert usage["finish"].opaque_calls and not usage["finish"].calls
    assert usage["flag"].stores == ["sglang/srt/runner.py:14"]
    assert set(usage["mem_pool_host"].chains) == {"mem_pool_host.alloc_slots()"}


def test_problems_conforming_class(synthetic: Path) -> None:
    assert problems(_Conforming, coordinator_usage(synthetic)) == []


def test_problems_removed_method(synthetic: Path) -> None:
    usage = coordinator_usage(synthetic)
    found = problems(_without(_Conforming, "retract_req"), usage)
    assert len(found) == 1 and found[0].startswith("retract_req: missing")
    assert "sglang/srt/runner.py:20" in found[0]
    # an instance attribute declared only as an annotation is found through the MRO
    assert any(p.startswith("flag: missing") for p in problems(_without(_Conforming, "flag"), usage))


def test_problems_incompatible_signature(synthetic: Path) -> None:
    def swap_in_selected_pages(self, req_pool_indices, seq_lens, topk):  # no layer_id
        pass

    bad = type("Bad", (_Conforming,), {"swap_in_selected_pages": swap_in_selected_pages})
    (found,) = problems(bad, coordinator_usage(synthetic))
    assert found.startswith("swap_in_selected_pages(") and "sglang/srt/runner.py:12" in found
    assert "layer_id" in found


def test_problems_method_used_as_value(synthetic: Path) -> None:
    bad = type("Bad", (_Conforming,), {"num_real_reqs": lambda self: None})
    (found,) = problems(bad, coordinator_usage(synthetic))
    assert "num_real_reqs" in found and "fill_" in found


def test_problems_class_api(synthetic: Path) -> None:
    api = class_api(synthetic, "sglang/srt/pool.py", "Pool")
    assert {m.kind for m in api.values()} == {"method", "property", "staticmethod"}

    class Ours:
        def __init__(self, size, page_size, device="cpu", extra=None):
            pass

        def write(self, layer, loc, dst_dtype=None):  # keyword-only there, either way here: fine
            pass

        @property
        def size(self):
            return 0

        def helper(self, x):  # a method where SGLang has a staticmethod: the call shape still binds
            return x

    assert problems(Ours, api) == []
    assert any(p.startswith("write: missing") for p in problems(_without(Ours, "write"), api))

    def write(self, layer, location, *, dst_dtype=None):  # renamed parameter
        pass

    (renamed,) = problems(type("Renamed", (Ours,), {"write": write}), api)
    assert renamed.startswith("write(") and "sglang/srt/pool.py" in renamed and "loc" in renamed

    def init(self, size, page_size):  # device dropped
        pass

    found = problems(type("NoDevice", (Ours,), {"__init__": init}), api)
    assert found and all(p.startswith("__init__(") for p in found)
    as_method = problems(type("SizeMethod", (Ours,), {"size": lambda self: 0}), api)
    assert as_method == [
        "size: a method on SizeMethod, but SGLang's Pool.size (sglang/srt/pool.py:10) is a property"
    ]


# --------------------------------------------------------------------------------------------------------
# Our classes against SGLang 0.5.23 (they land in coordinator.py, kv_pool.py and allocator.py)


def test_our_coordinator_conforms(usage: dict[str, Usage]) -> None:
    from ulakv.integrations.sglang.coordinator import UlakvSparseCoordinator

    assert problems(UlakvSparseCoordinator, usage) == []


def test_our_kv_pool_conforms(sglang_source: Path) -> None:
    from ulakv.integrations.sglang.kv_pool import UlakvKVPoolMixin

    assert problems(UlakvKVPoolMixin, class_api(sglang_source, *POOL_CLASS)) == []


def test_our_allocator_conforms(sglang_source: Path) -> None:
    from ulakv.integrations.sglang.allocator import UlakvAllocatorMixin

    assert problems(UlakvAllocatorMixin, class_api(sglang_source, *ALLOCATOR_CLASS)) == []


def test_check_bites_on_our_coordinator(usage: dict[str, Usage]) -> None:
    from ulakv.integrations.sglang.coordinator import UlakvSparseCoordinator

    found = problems(_without(UlakvSparseCoordinator, "swap_in_selected_pages"), usage)
    assert found and any(p.startswith("swap_in_selected_pages: missing") for p in found)


def test_check_bites_on_our_kv_pool(sglang_source: Path) -> None:
    from ulakv.integrations.sglang.kv_pool import UlakvKVPoolMixin

    found = problems(_without(UlakvKVPoolMixin, "set_mla_kv_buffer"), class_api(sglang_source, *POOL_CLASS))
    assert found and any(p.startswith("set_mla_kv_buffer: missing") for p in found)


def test_check_bites_on_our_allocator(sglang_source: Path) -> None:
    from ulakv.integrations.sglang.allocator import UlakvAllocatorMixin

    found = problems(_without(UlakvAllocatorMixin, "free"), class_api(sglang_source, *ALLOCATOR_CLASS))
    assert found and any(p.startswith("free: missing") for p in found)
