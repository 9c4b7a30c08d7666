"""How far our SGLang drop-ins fall short of what SGLang's own source expects of the classes they replace.

The adapter swaps three SGLang classes for ours: the HiSparse coordinator, the HiSparse DSA KV pool and
the HiSparse allocator. SGLang reaches into them from many files, so a missing attribute or a changed
parameter would only show on a GPU deep inside a serving run. This module reads SGLang's source with
``ast`` (never importing ``sglang``) and checks our classes with ``inspect``:

- ``coordinator_usage``: every member SGLang uses on the coordinator across ``sglang/srt`` (through any
  ``<x>.hisparse_coordinator``, a name bound from one, a ``hisparse_coordinator`` parameter or one
  annotated ``HiSparseCoordinator``), each call's shape, and the constructor call as ``__init__``;
- ``class_api``: the methods and properties of one class body (the pool's and the allocator's);
- ``problems``: what our class lacks or cannot accept, as readable lines (empty when it conforms).

``python -m tools.sglang_conformance [--source DIR]`` prints the tables and our classes'
problems (exit code 1 if any); ``--source`` may name an installed SGLang's site-packages directory.
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import inspect
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ALLOCATOR_CLASS",
    "COORDINATOR_CLASS",
    "POOL_CLASS",
    "ApiMember",
    "CallShape",
    "Param",
    "Usage",
    "class_api",
    "coordinator_usage",
    "main",
    "problems",
]

#: (module file, class name) of the SGLang classes our drop-ins replace.
COORDINATOR_CLASS = ("sglang/srt/managers/hisparse_coordinator.py", "HiSparseCoordinator")
POOL_CLASS = ("sglang/srt/mem_cache/hisparse_memory_pool.py", "HiSparseDSATokenToKVPool")
ALLOCATOR_CLASS = ("sglang/srt/mem_cache/allocator/hisparse.py", "HiSparseTokenToKVPoolAllocator")

#: The attribute through which SGLang reaches the coordinator (model runner, scheduler, batches, backends).
_COORD_ATTR = "hisparse_coordinator"
_COORD_RE = re.compile(rf"\b{COORDINATOR_CLASS[1]}\b")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


@dataclass(frozen=True)
class CallShape:
    """One call site: how many positional arguments and which keyword names (receiver not counted)."""

    n_positional: int
    keywords: tuple[str, ...]
    where: str

    def describe(self) -> str:
        kws = f"; keywords {', '.join(self.keywords)}" if self.keywords else ""
        return f"{self.n_positional} positional{kws}"


@dataclass
class Usage:
    """Everything SGLang does with one member of the coordinator."""

    name: str
    #: Every use, ``file:line`` relative to the source directory, in reading order.
    sites: list[str] = field(default_factory=list)
    #: Calls of the member whose shape is known (no ``*args``/``**kwargs`` at the call).
    calls: list[CallShape] = field(default_factory=list)
    #: Calls that spread ``*args``/``**kwargs`` (shape unknown, not checked).
    opaque_calls: list[str] = field(default_factory=list)
    #: How the member's value is used further, e.g. ``num_real_reqs.fill_()`` -> first site.
    chains: dict[str, str] = field(default_factory=dict)
    #: Sites that assign (or delete) the member.
    stores: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        """The files that use the member, sorted."""
        return sorted({s.rsplit(":", 1)[0] for s in self.sites})

    def _add_site(self, site: str) -> None:
        if site not in self.sites:
            self.sites.append(site)


@dataclass(frozen=True)
class Param:
    """One parameter of an SGLang signature, as the ast gives it."""

    name: str
    kind: inspect._ParameterKind
    has_default: bool


class _Default:
    """The placeholder default of a rebuilt SGLang signature; it prints (and re-parses) as ``...``."""

    def __repr__(self) -> str:
        return "..."


_DEFAULT = _Default()


@dataclass(frozen=True)
class ApiMember:
    """One method or property defined in an SGLang class body."""

    owner: str
    name: str
    #: "method", "staticmethod", "classmethod" or "property".
    kind: str
    #: The parameters, ``self``/``cls`` included for methods and classmethods.
    params: tuple[Param, ...]
    where: str
    #: For a property: whether the class body also defines its setter.
    settable: bool = False

    def signature(self) -> inspect.Signature:
        """An ``inspect.Signature`` of the SGLang member (defaults are placeholders)."""
        return inspect.Signature(
            [
                inspect.Parameter(
                    p.name, p.kind, default=_DEFAULT if p.has_default else inspect.Parameter.empty
                )
                for p in self.params
            ]
        )

    def call_params(self) -> tuple[Param, ...]:
        """The parameters a caller fills (``self``/``cls`` dropped)."""
        return self.params[1:] if self.kind in ("method", "classmethod") and self.params else self.params


# --------------------------------------------------------------------------------------------------------
# Reading the source


def _relpath(path: Path, source: Path) -> str:
    return path.relative_to(source).as_posix()


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:  # a newer SGLang on an older Python
        warnings.warn(f"skipping {path}: {exc}", stacklevel=3)
        return None


def _call_shape(call: ast.Call, where: str) -> CallShape | None:
    """The call's shape, or None when it spreads ``*args`` or ``**kwargs``."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    return CallShape(len(call.args), tuple(k.arg for k in call.keywords if k.arg is not None), where)


def _mentions_coordinator(annotation: ast.expr | None) -> bool:
    return annotation is not None and bool(_COORD_RE.search(ast.unparse(annotation)))


def _walk_scope(nodes: list[ast.AST]) -> Iterator[ast.AST]:
    """Every node of one scope; nested function and class definitions are yielded but not entered."""
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _DEFS):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


class _UsageScanner:
    """Finds the coordinator's members used in one file, scope by scope."""

    def __init__(self, rel: str, tree: ast.Module, out: dict[str, Usage]) -> None:
        self.rel = rel
        self.out = out
        self.parents: dict[ast.AST, ast.AST] = {
            child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)
        }
        self.scan(tree.body, frozenset(), in_class=False)

    def is_coordinator(self, expr: ast.AST, bound: frozenset[str] | set[str]) -> bool:
        """Whether ``expr`` evaluates to the coordinator."""
        if isinstance(expr, ast.Attribute):
            return expr.attr == _COORD_ATTR
        if isinstance(expr, ast.Name):
            return expr.id in bound
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr":
            return (
                len(expr.args) >= 2
                and isinstance(expr.args[1], ast.Constant)
                and expr.args[1].value == _COORD_ATTR
            )
        return False

    def scan(self, body: list[ast.AST], inherited: frozenset[str], *, in_class: bool) -> None:
        """Record the uses in one scope, then its nested scopes (a class body's names stay in it)."""
        nodes = list(_walk_scope(body))
        bound = set(inherited)
        changed = True
        while changed:  # aliases of aliases: c = self.hisparse_coordinator; d = c
            changed = False
            for node in nodes:
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign) and self.is_coordinator(node.value, bound):
                    targets = node.targets
                elif (
                    isinstance(node, ast.AnnAssign)
                    and (
                        (node.value is not None and self.is_coordinator(node.value, bound))
                        or _mentions_coordinator(node.annotation)
                    )
                ) or (isinstance(node, ast.NamedExpr) and self.is_coordinator(node.value, bound)):
                    targets = [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id not in bound:
                        bound.add(t.id)
                        changed = True
        frozen = frozenset(bound)
        for node in nodes:
            if isinstance(node, ast.Attribute) and self.is_coordinator(node.value, frozen):
                self.record(node.attr, node)
            elif isinstance(node, ast.Attribute) and (
                isinstance(node.value, ast.Name) and node.value.id == COORDINATOR_CLASS[1]
            ):
                self.record(node.attr, node)  # HiSparseCoordinator.<static or class member>
            elif isinstance(node, ast.Call) and self.is_constructor(node.func):
                self.record_call("__init__", node, f"{self.rel}:{node.lineno}")
        enclosing = inherited if in_class else frozen
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                self.scan(node.body, enclosing, in_class=True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                inner = set(enclosing)
                for p in params:
                    if p is None:
                        continue
                    if p.arg == _COORD_ATTR or _mentions_coordinator(p.annotation):
                        inner.add(p.arg)
                    else:
                        inner.discard(p.arg)  # a parameter shadows an outer alias
                self.scan(node.body, frozenset(inner), in_class=False)

    @staticmethod
    def is_constructor(func: ast.expr) -> bool:
        name = COORDINATOR_CLASS[1]
        return (isinstance(func, ast.Name) and func.id == name) or (
            isinstance(func, ast.Attribute) and func.attr == name
        )

    def usage(self, name: str) -> Usage:
        return self.out.setdefault(name, Usage(name))

    def record_call(self, name: str, call: ast.Call, site: str) -> None:
        usage = self.usage(name)
        usage._add_site(site)
        shape = _call_shape(call, site)
        if shape is None:
            usage.opaque_calls.append(site)
        else:
            usage.calls.append(shape)

    def record(self, name: str, node: ast.Attribute) -> None:
        site = f"{self.rel}:{node.lineno}"
        usage = self.usage(name)
        parent = self.parents.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            self.record_call(name, parent, site)
            return
        usage._add_site(site)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            usage.stores.append(site)
            return
        # How the value is used further: follow attribute accesses up, then note a call or subscript.
        chain, top = name, node
        while isinstance(parent, ast.Attribute) and parent.value is top:
            chain, top = f"{chain}.{parent.attr}", parent
            parent = self.parents.get(parent)
        if isinstance(parent, ast.Call) and parent.func is top:
            chain += "()"
        elif isinstance(parent, ast.Subscript) and parent.value is top:
            chain += "[]"
        if chain != name:
            usage.chains.setdefault(chain, site)


@functools.lru_cache(maxsize=8)
def _coordinator_usage_cached(source: str, scope: str, exclude: tuple[str, ...]) -> dict[str, Usage]:
    root = Path(source)
    out: dict[str, Usage] = {}
    for path in sorted((root / scope).rglob("*.py")):
        rel = _relpath(path, root)
        if rel in exclude:
            continue
        # Every pattern the scanner follows spells one of these two names; most files spell neither.
        text = path.read_text(encoding="utf-8", errors="replace")
        if _COORD_ATTR not in text and COORDINATOR_CLASS[1] not in text:
            continue
        tree = _parse(path)
        if tree is not None:
            _UsageScanner(rel, tree, out)
    return dict(sorted(out.items()))


def coordinator_usage(
    source: Path, *, scope: str = "sglang/srt", exclude: tuple[str, ...] = (COORDINATOR_CLASS[0],)
) -> dict[str, Usage]:
    """Every member SGLang uses on the HiSparse coordinator, by name (``__init__`` for the constructor).

    ``source`` holds the ``sglang/`` package; ``scope`` is the folder scanned; files in ``exclude`` (by
    default the coordinator's own module, whose ``self.X`` are its internals) are skipped.
    """
    source = Path(source).resolve()
    if not (source / scope).is_dir():
        raise FileNotFoundError(f"{source / scope} not found: is {source} an SGLang source tree?")
    return copy.deepcopy(_coordinator_usage_cached(str(source), scope, tuple(exclude)))


def _params(args: ast.arguments) -> tuple[Param, ...]:
    kinds = inspect.Parameter
    positional = [(a, kinds.POSITIONAL_ONLY) for a in args.posonlyargs]
    positional += [(a, kinds.POSITIONAL_OR_KEYWORD) for a in args.args]
    first_default = len(positional) - len(args.defaults)
    out = [Param(a.arg, kind, i >= first_default) for i, (a, kind) in enumerate(positional)]
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, kinds.VAR_POSITIONAL, False))
    out += [
        Param(a.arg, kinds.KEYWORD_ONLY, d is not None)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, kinds.VAR_KEYWORD, False))
    return tuple(out)


def _decorator_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    names = []
    for d in func.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        names.append(ast.unparse(target))
    return names


def class_api(source: Path, module_path: str, class_name: str) -> dict[str, ApiMember]:
    """The methods and properties defined in the body of ``class_name`` in ``module_path``.

    ``module_path`` is a file under ``source`` (``sglang/srt/mem_cache/hisparse_memory_pool.py``) or
    its dotted module name. Inherited members are not included: the class body is what a drop-in adds.
    """
    source = Path(source).resolve()
    rel = module_path if module_path.endswith(".py") else module_path.replace(".", "/") + ".py"
    path = source / rel
    tree = _parse(path) if path.is_file() else None
    if tree is None:
        raise FileNotFoundError(f"cannot read {path}")
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"no class {class_name} in {rel}")
    api: dict[str, ApiMember] = {}
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = _decorator_names(node)
        if any(d.endswith((".setter", ".deleter")) for d in decorators):
            prop = api.get(node.name)
            if prop is not None and prop.kind == "property":
                api[node.name] = ApiMember(prop.owner, prop.name, prop.kind, prop.params, prop.where, True)
            continue
        if any(d in ("property", "functools.cached_property", "cached_property") for d in decorators):
            kind = "property"
        elif "staticmethod" in decorators:
            kind = "staticmethod"
        elif "classmethod" in decorators:
            kind = "classmethod"
        else:
            kind = "method"
        api[node.name] = ApiMember(class_name, node.name, kind, _params(node.args), f"{rel}:{node.lineno}")
    return api


# --------------------------------------------------------------------------------------------------------
# Checking our classes


@dataclass(frozen=True)
class _Ours:
    """What a name is on our class: its kind and, for callables, the function and whether it takes self."""

    kind: str  # "missing", "function", "property", "annotation" or "value"
    obj: object = None
    takes_self: bool = False


def _lookup(cls: type, name: str) -> _Ours:
    for klass in cls.__mro__:
        if name in vars(klass):
            raw = vars(klass)[name]
            if isinstance(raw, staticmethod):
                return _Ours("function", raw.__func__, False)
            if isinstance(raw, classmethod):
                return _Ours("function", raw.__func__, True)
            if isinstance(raw, (property, functools.cached_property)):
                return _Ours("property", raw)
            if inspect.isroutine(raw):
                return _Ours("function", raw, True)
            return _Ours("value", raw)
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return _Ours("annotation")
    if hasattr(cls, name):  # a metaclass or __getattr__ trick: present, shape unknown
        return _Ours("value", getattr(cls, name))
    return _Ours("missing")


def _signature(ours: _Ours) -> inspect.Signature | None:
    try:
        return inspect.signature(ours.obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # some builtins have none
        return None


def _bind_error(ours: _Ours, n_positional: int, keywords: tuple[str, ...]) -> str | None:
    """Why our callable cannot take a call of this shape (None when it can, or when unknowable)."""
    sig = _signature(ours)
    if sig is None:
        return None
    args = [None] * (n_positional + (1 if ours.takes_self else 0))
    try:
        sig.bind(*args, **dict.fromkeys(keywords))
    except TypeError as exc:
        return str(exc)
    return None


def _sig_text(ours: _Ours) -> str:
    sig = _signature(ours)
    return str(sig) if sig is not None else "(?)"


def _usage_problems(cls: type, usage: Usage) -> list[str]:
    name = usage.name
    first = usage.sites[0] if usage.sites else "?"
    more = f" (+{len(usage.sites) - 1} more)" if len(usage.sites) > 1 else ""
    ours = _lookup(cls, name)
    if ours.kind == "missing":
        return [f"{name}: missing on {cls.__name__}; SGLang uses it at {first}{more}"]
    out: list[str] = []
    if ours.kind == "function":
        seen: set[tuple[int, tuple[str, ...]]] = set()
        for call in usage.calls:
            key = (call.n_positional, tuple(sorted(call.keywords)))
            if key in seen:
                continue
            seen.add(key)
            err = _bind_error(ours, call.n_positional, call.keywords)
            if err is not None:
                out.append(
                    f"{name}{_sig_text(ours)}: cannot take SGLang's call at {call.where} "
                    f"({call.describe()}): {err}"
                )
        for chain, site in usage.chains.items():  # e.g. num_real_reqs.fill_(): a value, not a method
            out.append(f"{name}: SGLang uses its value ({chain}) at {site}, but ours is a method")
            break
    return out


def _api_shapes(member: ApiMember) -> list[tuple[str, int, tuple[str, ...]]]:
    """Calls SGLang's signature accepts that a drop-in must accept too: (description, positional, kws)."""
    kinds = inspect.Parameter
    params = member.call_params()
    pos = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    kwonly = [p for p in params if p.kind == kinds.KEYWORD_ONLY]
    req_pos = [p for p in pos if not p.has_default]
    req_kw = tuple(p.name for p in kwonly if not p.has_default)
    shapes = [("its required arguments", len(req_pos), req_kw)]
    if len(pos) > len(req_pos):
        shapes.append(("all positional parameters by position", len(pos), req_kw))
    by_name = tuple(p.name for p in pos if p.kind == kinds.POSITIONAL_OR_KEYWORD) + tuple(
        p.name for p in kwonly
    )
    n_posonly = sum(p.kind == kinds.POSITIONAL_ONLY for p in req_pos)
    if by_name and by_name != req_kw:
        shapes.append(("every parameter by keyword", n_posonly, by_name))
    if any(p.kind == kinds.VAR_POSITIONAL for p in params):
        shapes.append(("extra positional arguments (*args)", len(pos) + 1, req_kw))
    if any(p.kind == kinds.VAR_KEYWORD for p in params):
        shapes.append(("extra keyword arguments (**kwargs)", len(req_pos), (*req_kw, "_extra_keyword_")))
    return shapes


def _api_problems(cls: type, member: ApiMember) -> list[str]:
    name = member.name
    theirs = f"SGLang's {member.owner}.{name} ({member.where})"
    ours = _lookup(cls, name)
    if ours.kind == "missing":
        return [f"{name}: missing on {cls.__name__}; {theirs} is a {member.kind}"]
    if member.kind == "property":
        if ours.kind == "function":
            return [f"{name}: a method on {cls.__name__}, but {theirs} is a property"]
        if member.settable and ours.kind == "property" and getattr(ours.obj, "fset", True) is None:
            return [f"{name}: read-only property on {cls.__name__}, but {theirs} has a setter"]
        return []
    if ours.kind != "function":
        return [f"{name}: a {ours.kind} on {cls.__name__}, but {theirs} is a {member.kind}"]
    out = []
    for what, n_positional, keywords in _api_shapes(member):
        err = _bind_error(ours, n_positional, keywords)
        if err is not None:
            out.append(
                f"{name}{_sig_text(ours)}: {theirs}{member.signature()} accepts {what} "
                f"({n_positional} positional; keywords {', '.join(keywords) or 'none'}); ours does not: {err}"
            )
    return out


def problems(our_cls: type, usage_or_api: Mapping[str, Usage] | Mapping[str, ApiMember]) -> list[str]:
    """How ``our_cls`` falls short of SGLang's usage (``coordinator_usage``) or class API (``class_api``).

    Empty when it conforms. A used or defined name must exist on our class (or be declared in an
    ``__annotations__`` of its MRO); our methods must bind every SGLang call shape. Each line names the
    member, the SGLang ``file:line`` and what is wrong.
    """
    out: list[str] = []
    for item in usage_or_api.values():
        if isinstance(item, Usage):
            out += _usage_problems(our_cls, item)
        elif isinstance(item, ApiMember):
            out += _api_problems(our_cls, item)
        else:
            raise TypeError(f"expected Usage or ApiMember values, got {type(item).__name__}")
    return out


# --------------------------------------------------------------------------------------------------------
# Command line


def _source_version(source: Path) -> str:
    version_file = source / "sglang" / "_version.py"
    if version_file.is_file():
        match = re.search(
            r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_file.read_text()
        )
        if match:
            return match.group(1)
    return "unknown version"


def _print_usage_table(usage: Mapping[str, Usage]) -> None:
    width = max((len(n) for n in usage), default=10)
    for name, u in usage.items():
        shapes = sorted({c.describe() for c in u.calls})
        extra = []
        if shapes:
            extra.append("calls: " + " | ".join(shapes))
        if u.opaque_calls:
            extra.append(f"{len(u.opaque_calls)} call(s) with *args/**kwargs")
        if u.chains:
            extra.append("as value: " + ", ".join(sorted(u.chains)))
        if u.stores:
            extra.append(f"assigned at {', '.join(u.stores)}")
        print(f"  {name:<{width}}  {len(u.sites):>2} use(s)  {', '.join(u.files)}")
        for line in extra:
            print(f"  {'':<{width}}            {line}")


def _print_api(api: Mapping[str, ApiMember]) -> None:
    for m in api.values():
        sig = "" if m.kind == "property" else str(m.signature())
        note = " (settable)" if m.settable else ""
        print(f"  {m.kind:<12} {m.name}{sig}{note}  [{m.where}]")


def _our_classes() -> list[tuple[str, str, str]]:
    return [
        ("ulakv.integrations.sglang.coordinator", "UlakvSparseCoordinator", "coordinator"),
        ("ulakv.integrations.sglang.kv_pool", "UlakvKVPoolMixin", "pool"),
        ("ulakv.integrations.sglang.allocator", "UlakvAllocatorMixin", "allocator"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Print what SGLang uses of the three classes and our drop-ins' problems; 1 if there are any."""
    parser = argparse.ArgumentParser(prog="python -m tools.sglang_conformance", description=__doc__)
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        help="directory holding the sglang/ package (default: the pinned wheel, fetched into the cache)",
    )
    args = parser.parse_args(argv)
    if args.source is None:
        from tools.sglang_wheel import wheel_source

        source = wheel_source()
    else:
        source = args.source
    print(f"SGLang source: {source} ({_source_version(source)})\n")

    checks: dict[str, Mapping[str, Usage] | Mapping[str, ApiMember]] = {
        "coordinator": coordinator_usage(source),
        "pool": class_api(source, *POOL_CLASS),
        "allocator": class_api(source, *ALLOCATOR_CLASS),
    }
    print(f"{COORDINATOR_CLASS[1]}: members SGLang uses (outside {COORDINATOR_CLASS[0]})")
    _print_usage_table(checks["coordinator"])  # type: ignore[arg-type]
    for key, (module, cls_name) in (("pool", POOL_CLASS), ("allocator", ALLOCATOR_CLASS)):
        print(f"\n{cls_name}: class body ({module})")
        _print_api(checks[key])  # type: ignore[arg-type]

    total = 0
    for module_name, class_name, key in _our_classes():
        print(f"\n{class_name} ({module_name}) against the {key}:")
        try:
            module = __import__(module_name, fromlist=[class_name])
            ours = getattr(module, class_name)
        except (ImportError, AttributeError) as exc:
            print(f"  cannot import: {exc}")
            total += 1
            continue
        found = problems(ours, checks[key])
        total += len(found)
        for line in found:
            print(f"  - {line}")
        if not found:
            print("  conforms")
    print(f"\n{total} problem(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
