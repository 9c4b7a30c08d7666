"""What the DCP path and the shared top-k rely on in SGLang's source, checked with ``ast``.

``DcpLocalizer`` stands in for SGLang's ``localize_dcp_page_table`` (and its kernel
``transform_index_page_table_dcp``) and reuses a localisation by the same key (the next layer, the
same top-k tensor), producing what ``dcp_trtllm_sparse_attention`` reads
(``block_tables`` and the ``sparse_mla_top_k_lens`` keyword); ``layer_groups`` mirrors
``dsa_layer_skips_topk``, and the KV pool takes ``skip_topk_layers``. A renamed parameter, a
function gone, a call site passing a keyword the function no longer takes, or a new rule in
``dsa_layer_skips_topk`` (a configuration attribute our mirror does not read) would only show on a
GPU; ``problems(source)`` names each as a line (empty when everything is where the adapter expects).

``dcp_hooks`` hooks SGLang under ``--enable-hisparse --dcp-size``; ``hook_problems(source)`` checks
that each hooked name exists and is used as the hook assumes: the refusal it lifts, the call by bare
name that a module-level replacement reaches, the attributes read and assigned, SGLang's row writer
taking widened ids under DCP, the positional
``forward_batch`` and the ``is_prefill`` keyword, the allocator SGLang builds unwidened under
HiSparse, the index buffer counted ``dcp_size`` times in the memory profile, and the hook registry's
calling conventions.

``python -m tools.sglang_dcp_conformance [--source DIR]`` prints them (exit code 1 if any).
"""

from __future__ import annotations

import argparse
import ast
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EXPECTED", "Expected", "hook_problems", "main", "problems"]


@dataclass(frozen=True)
class Expected:
    """A name of SGLang's the DCP path relies on: a function or class in ``module`` (a file under the
    source), the parameters (a class: the fields) it must have, in this order among its own, and the
    string keys its body must read (``kwargs.pop("...")``, ``getattr(config, "...")``); ``exact``:
    those keys and no others (a new rule would change what the mirror must do)."""

    module: str
    name: str
    params: tuple[str, ...]
    reads: tuple[str, ...] = ()
    exact: bool = False


_DSA_DCP = "sglang/srt/layers/attention/dsa/dsa_dcp.py"
EXPECTED = (
    Expected(
        "sglang/kernels/ops/attention/dsa/transform_index.py",
        "transform_index_page_table_dcp",
        ("page_table", "dcp_size", "dcp_rank"),
    ),
    Expected(
        _DSA_DCP,
        "localize_dcp_page_table",
        ("cache", "metadata", "layer_id", "topk_indices", "page_table", "dcp_size", "dcp_rank"),
    ),
    Expected(_DSA_DCP, "DcpPageTableCache", ("metadata", "layer_id", "topk_indices", "page_table", "counts")),
    Expected(
        _DSA_DCP,
        "dcp_trtllm_sparse_attention",
        ("query", "block_tables", "seq_lens", "cu_seqlens_q"),
        reads=("sparse_mla_top_k_lens",),
    ),
    Expected(
        "sglang/srt/configs/model_config.py",
        "dsa_layer_skips_topk",
        ("config", "layer_id"),
        reads=(
            "indexer_types",
            "cli_factor",
            "index_topk_pattern",
            "index_topk_freq",
            "index_skip_topk_offset",
        ),
        exact=True,
    ),
    Expected(
        "sglang/srt/mem_cache/memory_pool.py", "DSATokenToKVPool.__init__", ("size", "skip_topk_layers")
    ),
)

# Functions whose call sites under sglang/srt must pass only keywords the function takes.
CALLED = ("localize_dcp_page_table", "dcp_trtllm_sparse_attention", "transform_index_page_table_dcp")


def _find(tree: ast.Module, dotted: str) -> ast.FunctionDef | ast.ClassDef | None:
    nodes: list[ast.stmt] = tree.body
    found = None
    for part in dotted.split("."):
        found = next(
            (n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None
        )
        if found is None:
            return None
        nodes = found.body
    return found


def _names(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    if isinstance(node, ast.ClassDef):  # a struct's fields: annotated names of its body
        return [
            n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        ]
    a = node.args
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _string_keys(node: ast.AST) -> set[str]:
    """String constants passed as the second argument of ``getattr`` or the first of ``pop``/``get``."""
    keys = set()
    for call in ast.walk(node):
        if not isinstance(call, ast.Call) or not call.args:
            continue
        func = call.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(call.args) >= 2:
            arg = call.args[1]
        elif isinstance(func, ast.Attribute) and func.attr in ("pop", "get"):
            arg = call.args[0]
        else:
            continue
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            keys.add(arg.value)
    return keys


def _in_order(want: tuple[str, ...], have: list[str]) -> bool:
    at = [have.index(w) for w in want if w in have]
    return len(at) == len(want) and at == sorted(at)


def _reuse_key_problems(node: ast.AST) -> list[str]:
    """``DcpLocalizer`` reuses a localisation as ``localize_dcp_page_table`` does: for the next
    layer (``layer_id - 1``) and the same top-k tensor (``... is topk_indices``). Says what no
    longer holds."""
    identity = any(
        isinstance(n, ast.Compare)
        and any(isinstance(op, ast.Is) for op in n.ops)
        and any(isinstance(c, ast.Name) and c.id == "topk_indices" for c in n.comparators)
        for n in ast.walk(node)
    )
    previous = any(
        isinstance(n, ast.BinOp)
        and isinstance(n.op, ast.Sub)
        and isinstance(n.left, ast.Name)
        and n.left.id == "layer_id"
        and isinstance(n.right, ast.Constant)
        and n.right.value == 1
        for n in ast.walk(node)
    )
    found = []
    if not identity:
        found.append("localize_dcp_page_table: no longer reuses by the top-k tensor's identity")
    if not previous:
        found.append("localize_dcp_page_table: no longer reuses for the next layer only (layer_id - 1)")
    return found


def problems(source: Path) -> list[str]:
    """What the DCP path expects of the SGLang source at ``source`` (the directory holding
    ``sglang/``) and does not find, a line each."""
    source = Path(source)
    found: list[str] = []
    params: dict[str, list[str]] = {}
    for exp in EXPECTED:
        path = source / exp.module
        if not path.is_file():
            found.append(f"{exp.module}: missing (holds {exp.name})")
            continue
        node = _find(ast.parse(path.read_text(encoding="utf-8")), exp.name)
        if node is None:
            found.append(f"{exp.module}: no {exp.name}")
            continue
        have = _names(node)
        params[exp.name] = have
        if exp.name == "localize_dcp_page_table":
            found += _reuse_key_problems(node)
        if not _in_order(exp.params, have):
            found.append(f"{exp.name} ({exp.module}:{node.lineno}): expected {list(exp.params)} among {have}")
        keys = _string_keys(node)
        missing = sorted(set(exp.reads) - keys)
        if missing:
            found.append(f"{exp.name}: no longer reads {missing}")
        extra = sorted(keys - set(exp.reads)) if exp.exact else []
        if extra:
            found.append(f"{exp.name}: reads {extra}, which ulakv's mirror does not (a new rule?)")
    sites = {name: 0 for name in CALLED}
    for path in sorted((source / "sglang/srt").rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            if not any(name in text for name in CALLED):  # most files: no parse
                continue
            with warnings.catch_warnings():  # SGLang's own invalid escapes, not ours to report
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            if name not in sites:
                continue
            sites[name] += 1
            takes = params.get(name, [])
            unknown = [k.arg for k in call.keywords if k.arg is not None and k.arg not in takes]
            if takes and unknown and name != "dcp_trtllm_sparse_attention":  # it takes **attention_kwargs
                rel = path.relative_to(source).as_posix()
                found.append(f"{rel}:{call.lineno}: {name} called with {unknown}, which it does not take")
    for name in ("localize_dcp_page_table", "dcp_trtllm_sparse_attention"):
        if not sites[name]:
            found.append(f"sglang/srt no longer calls {name}: the DCP attention path moved")
    return found


def _tree(source: Path, module: str) -> ast.Module | None:
    path = source / module
    if not path.is_file():
        return None
    with warnings.catch_warnings():  # SGLang's own invalid escapes, not ours to report
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(path.read_text(encoding="utf-8"))


def _reads(node: ast.AST, base: str) -> set[str]:
    """Attributes read or assigned on the name ``base`` (``cfg.x``, ``self.x``)."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == base
    }


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of ``name`` (bare, or as an attribute: ``self.name(...)``)."""
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and ((isinstance(n.func, ast.Name) and n.func.id == name) or getattr(n.func, "attr", None) == name)
    ]


_OVERRIDES = "sglang/srt/arg_groups/model_overrides/deepseek_v2.py"
_CONFIGURATOR = "sglang/srt/mem_cache/kv_cache_configurator.py"
_BACKEND = "sglang/srt/layers/attention/dsa_backend.py"


def hook_problems(source: Path) -> list[str]:
    """What ``dcp_hooks`` expects of the SGLang source at ``source`` and does not find, a line each."""
    from ulakv.integrations.sglang.dcp_hooks import DCP_HOOKS

    source = Path(source)
    found: list[str] = []
    trees: dict[str, ast.Module | None] = {}

    def node(module: str, dotted: str) -> ast.FunctionDef | ast.ClassDef | None:
        if module not in trees:
            trees[module] = _tree(source, module)
        tree = trees[module]
        got = None if tree is None else _find(tree, dotted)
        if got is None:
            found.append(
                f"{module}: no {dotted}" if tree is not None else f"{module}: missing (holds {dotted})"
            )
        return got

    # Every hooked target: module path and dotted name as SGLang's registry resolves them.
    for target in DCP_HOOKS:
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = "/".join(parts[:cut]) + ".py"
            if (source / module).is_file():
                node(module, ".".join(parts[cut:]))
                break
        else:
            found.append(f"{target}: no module of it under {source}")

    overrides = node(_OVERRIDES, "_dsa_dcp_overrides")
    if overrides is not None:
        if _names(overrides) != ["cfg"]:
            found.append(f"_dsa_dcp_overrides: expected (cfg), got {_names(overrides)}")
        want = {"dcp_size", "enable_hisparse", "enable_hierarchical_cache"}
        if not want <= _reads(overrides, "cfg"):
            found.append(f"_dsa_dcp_overrides: no longer reads cfg.{sorted(want - _reads(overrides, 'cfg'))}")
        if not any("HiSparse" in str(getattr(n, "value", "")) for n in ast.walk(overrides)):
            found.append("_dsa_dcp_overrides: no longer refuses HiSparse (the hook lifts that refusal)")
    family = node(_OVERRIDES, "_deepseek_family_overrides")
    if family is not None and not any(
        isinstance(c.func, ast.Name) for c in _calls(family, "_dsa_dcp_overrides")
    ):
        found.append(
            "_deepseek_family_overrides: no longer calls _dsa_dcp_overrides by name (the hook misses it)"
        )

    build = node(_CONFIGURATOR, "KVCacheConfigurator._build_dsa_kv_pool")
    if build is not None:
        text = ast.unparse(build)
        for chain in (
            "self.model_config.hf_config",
            "self.layer_info.start_layer",
            "self.layer_info.end_layer",
        ):
            if chain not in text:
                found.append(f"_build_dsa_kv_pool: no longer reads {chain} (record_model_groups does)")
        if not any(isinstance(n, ast.Name) and n.id == "HiSparseDSATokenToKVPool" for n in ast.walk(build)):
            found.append(
                "_build_dsa_kv_pool: no longer builds HiSparseDSATokenToKVPool (the groups reach no pool)"
            )
    tree = trees.get(_CONFIGURATOR)
    if tree is not None:
        sites = _calls(tree, "HiSparseTokenToKVPoolAllocator")
        unwidened = [
            c
            for c in sites
            if c.args and isinstance(c.args[0], ast.Attribute) and c.args[0].attr == "max_total_num_tokens"
        ]
        if not unwidened:
            found.append(
                "HiSparseTokenToKVPoolAllocator is no longer built with sizes.max_total_num_tokens "
                "(the adapter's allocator widens it by dcp_size itself)"
            )

    init = node(_BACKEND, "DeepseekSparseAttnBackend.__init__")
    if init is not None:
        assigned = {
            t.attr
            for n in ast.walk(init)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Attribute)
        }
        for attr in ("_dcp_page_table_cache", "token_to_kv_pool"):
            if attr not in assigned:
                found.append(f"DeepseekSparseAttnBackend.__init__: no longer sets self.{attr}")
    trtllm = node(_BACKEND, "DeepseekSparseAttnBackend._forward_trtllm")
    if trtllm is not None:
        have = _names(trtllm)
        if have[:6] != ["self", "q", "k", "v", "layer", "forward_batch"] or "is_prefill" not in have:
            want = "(self, q, k, v, layer, forward_batch, ..., is_prefill)"
            found.append(f"_forward_trtllm: expected {want}, got {have}")
        first = [c.args[0] for c in _calls(trtllm, "localize_dcp_page_table") if c.args]
        if not any(isinstance(a, ast.Attribute) and a.attr == "_dcp_page_table_cache" for a in first):
            found.append("_forward_trtllm: no longer localises through self._dcp_page_table_cache")
    extend = node(_BACKEND, "DeepseekSparseAttnBackend.forward_extend")
    if extend is not None:
        keywords = [k.arg for c in _calls(extend, "_forward_trtllm") for k in c.keywords]
        if "is_prefill" not in keywords:
            found.append(
                "forward_extend: no longer calls _forward_trtllm with is_prefill= (mark_prefill reads it)"
            )

    # The KV pool packs rows with SGLang's writer at ids ``i x D + rank``: under DCP it scatters
    # widened ids (this rank's, collapsed by ``// D``).
    scatter = node("sglang/srt/mem_cache/memory_pool.py", "MLATokenToKVPool._scatter_mla_rows")
    if scatter is not None and not _calls(scatter, "set_mla_kv_buffer_dcp_sharded_triton"):
        found.append("MLATokenToKVPool._scatter_mla_rows: no longer scatters widened ids under DCP")
    sharded = node("sglang/kernels/ops/kvcache/mla_buffer.py", "set_mla_kv_buffer_dcp_sharded_triton")
    if sharded is not None:
        keywords = {k.arg for c in _calls(sharded, "_set_mla_kv_buffer_impl") for k in c.keywords}
        if not {"dcp_world_size", "dcp_rank"} <= keywords:
            found.append(
                "set_mla_kv_buffer_dcp_sharded_triton: no longer selects by dcp_world_size, dcp_rank"
            )

    profile = _tree(source, "sglang/srt/model_executor/pool_configurator.py")
    counted = profile is not None and any(
        isinstance(n, ast.AugAssign)
        and isinstance(n.target, ast.Name)
        and n.target.id == "indexer_cell_size"
        and isinstance(n.value, ast.Name)
        and n.value.id == "dcp_size"
        for n in ast.walk(profile)
    )
    if not counted:
        found.append(
            "pool_configurator: the index keys are no longer counted dcp_size times (the pool sizes them so)"
        )
    context = source / "sglang/srt/runtime_context.py"
    fields = source / "sglang/srt/arg_groups/fields/parallel.py"
    if not context.is_file() or "def get_parallel(" not in context.read_text(encoding="utf-8"):
        found.append("sglang/srt/runtime_context.py: no get_parallel (dcp_group reads it)")
    if not fields.is_file() or "attn_dcp_rank" not in fields.read_text(encoding="utf-8"):
        found.append("ParallelContext: no attn_dcp_rank (dcp_group reads it)")

    registry = _tree(source, "sglang/srt/plugins/hook_registry.py")
    wrap = None if registry is None else _find(registry, "_wrap_fn")
    text = "" if wrap is None else ast.unparse(wrap)
    for convention in ("hook(original_fn, *args, **kwargs)", "hook(result, *args, **kwargs)"):
        if convention not in text:
            found.append(f"hook_registry._wrap_fn: no longer calls {convention}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sglang_dcp_conformance")
    parser.add_argument(
        "--source", type=Path, default=None, help="directory holding sglang/ (default: the pinned wheel)"
    )
    args = parser.parse_args(argv)
    if args.source is None:
        from tools.sglang_wheel import wheel_source

        args.source = wheel_source()
    found = problems(args.source) + hook_problems(args.source)
    for line in found:
        print(f"- {line}")
    print(f"{len(found)} problem(s) in what the DCP path and the shared top-k expect of {args.source}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
