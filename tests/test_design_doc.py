"""The design document stays true to the code, and the repository stands on its own.

- Every line of a ```signature block in ``docs/*.md`` names a public callable by its import path and
  writes its signature as Python. The callable is imported (``ulakv.Pool.<method>`` resolves against
  ``ulakv.layouts.tiered.TieredPool``, the kind ``Pool(config)`` builds for a tiered layout; ``ulakv.Pool``
  itself is the factory) and compared with ``inspect.signature``: parameter names, order, kinds and
  defaults must be equal, and so must annotations, compared as strings: both sides are parsed and
  unparsed by ``ast`` (so spacing and quotes do not matter) and a bare ``Tensor`` reads as
  ``torch.Tensor``. Return annotations are compared for functions, not for classes. A documented
  default is evaluated (``Phase.COMMIT``, ``ExactLRU()``, ``{}``) and compared by equality, against
  the factory's product for a dataclass field with a ``default_factory``.
- Every public method of the pool, the engine adapter and the transfer plan has a signature line.
- Every name in ``__all__`` of ``ulakv``, ``ulakv.layouts``, ``ulakv.policies`` and ``ulakv.engine``
  appears in the design document.
- The layering table of ``docs/design.md`` holds: every module of ``ulakv/`` is in one row, and no
  module imports from a row above its own.
- Every relative markdown link in README.md and ``docs/*.md`` resolves to a file inside the
  repository (and an ``#anchor`` to a heading of it); no text in README.md, docs/, ulakv/ or
  benchmarks/ points outside the repository.
- No module of the package reads another module's private attributes (``obj._name``, ``obj`` not
  ``self``/``cls``/``super()``, ``_name`` defined only by other modules' classes).
- The package imports none of the repository's developer tools (``tools/``): ``import ulakv`` and
  the SGLang plugin load none of them.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ulakv
import ulakv.engine
import ulakv.layouts
import ulakv.policies
from ulakv.engine import GroupStep, SparseKV
from ulakv.layouts.tiered import TieredPool
from ulakv.transfer import Phase, TransferPlan

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
POOL_PREFIX = "ulakv.Pool."

# --------------------------------------------------------------------------------------------------
# signature blocks


def signature_lines(text: str) -> list[str]:
    """The lines of every ```signature block of a markdown text."""
    lines = []
    for block in re.findall(r"^```signature[ \t]*\n(.*?)^```", text, flags=re.S | re.M):
        lines += [line.strip() for line in block.splitlines() if line.strip()]
    return lines


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def documented_signatures() -> list[str]:
    return [line for path in doc_files() for line in signature_lines(path.read_text())]


def resolve(dotted: str) -> object:
    """The object a dotted path names: the longest importable module prefix, then attributes.
    ``ulakv.Pool.<name>`` is looked up on ``TieredPool``."""
    if dotted.startswith(POOL_PREFIX):
        obj: object = TieredPool
        rest = dotted[len(POOL_PREFIX) :].split(".")
    else:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            rest = parts[i:]
            break
        else:
            raise LookupError(f"no module in {dotted!r} can be imported")
    for name in rest:
        if not hasattr(obj, name):
            raise LookupError(f"{dotted}: {name!r} not found")
        obj = getattr(obj, name)
    return obj


def _norm_annotation(text: str | None) -> str | None:
    if text is None:
        return None
    with contextlib.suppress(SyntaxError):  # compared as written
        text = ast.unparse(ast.parse(text, mode="eval"))
    return re.sub(r"(?<![\w.])Tensor\b", "torch.Tensor", text)


def _actual_annotation(annotation: object) -> str | None:
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):
        return _norm_annotation(annotation)
    return _norm_annotation(inspect.formatannotation(annotation))


def _namespace() -> dict[str, object]:
    import ulakv.transfer

    names: dict[str, object] = {"ulakv": ulakv, "torch": torch, "Phase": Phase}
    for module in (ulakv, ulakv.layouts, ulakv.policies, ulakv.engine, ulakv.transfer):
        names.update({n: getattr(module, n) for n in dir(module) if not n.startswith("_")})
    return names


_MISSING = object()


def _actual_default(obj: object, param: inspect.Parameter) -> object:
    """A parameter's default; for a dataclass field made by a factory, what the factory makes."""
    if param.default is inspect.Parameter.empty:
        return _MISSING
    if param.default is dataclasses._HAS_DEFAULT_FACTORY and inspect.isclass(obj):
        field = {f.name: f for f in dataclasses.fields(obj)}[param.name]
        return field.default_factory()
    return param.default


def parse_signature_line(line: str) -> tuple[str, list[tuple], str | None]:
    """``dotted.name(params) -> ret`` as (dotted name, [(name, kind, default source, annotation)],
    return annotation); raises SyntaxError for a line that is not a Python signature."""
    at = line.find("(")
    if at <= 0:
        raise SyntaxError(f"not a signature: {line!r}")
    dotted, rest = line[:at].strip(), line[at:]
    fn = ast.parse(f"def _f{rest}: ...").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    unparse = lambda node: None if node is None else ast.unparse(node)
    params: list[tuple] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(a.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        params.append((arg.arg, kind, unparse(default), unparse(arg.annotation)))
    if a.vararg is not None:
        params.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None, unparse(a.vararg.annotation)))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        params.append((arg.arg, inspect.Parameter.KEYWORD_ONLY, unparse(default), unparse(arg.annotation)))
    if a.kwarg is not None:
        params.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None, unparse(a.kwarg.annotation)))
    return dotted, params, unparse(fn.returns)


def check_signature_line(line: str) -> list[str]:
    """Every way ``line`` disagrees with the code, each message naming the callable; [] if none."""
    try:
        dotted, params, returns = parse_signature_line(line)
    except SyntaxError as exc:
        return [f"{line!r}: not a Python signature ({exc})"]
    try:
        obj = resolve(dotted)
    except LookupError as exc:
        return [f"{dotted}: documented but missing from the code ({exc})"]
    try:
        actual = inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        return [f"{dotted}: no signature to compare ({exc})"]
    problems = []
    documented = [p[0] for p in params]
    in_code = list(actual.parameters)
    if documented != in_code:
        problems.append(f"{dotted}: parameters {documented} documented, {in_code} in the code")
    namespace = _namespace()
    for name, kind, default, annotation in params:
        if name not in actual.parameters:
            continue
        real = actual.parameters[name]
        if real.kind != kind:
            problems.append(
                f"{dotted}: parameter {name!r} is {real.kind.description} in the code, "
                f"{kind.description} here"
            )
        want = _actual_default(obj, real)
        if default is None:
            if want is not _MISSING:
                problems.append(
                    f"{dotted}: parameter {name!r} has default {want!r} in the code, none documented"
                )
        elif want is _MISSING:
            problems.append(f"{dotted}: parameter {name!r} has no default in the code, {default} documented")
        else:
            try:
                value = eval(default, dict(namespace))  # our own document
            except Exception as exc:
                problems.append(f"{dotted}: default {default!r} of {name!r} does not evaluate ({exc})")
            else:
                if type(value) is not type(want) or value != want:
                    problems.append(
                        f"{dotted}: parameter {name!r} defaults to {want!r} in the code, {default} documented"
                    )
        doc_ann, code_ann = _norm_annotation(annotation), _actual_annotation(real.annotation)
        if doc_ann != code_ann:
            problems.append(
                f"{dotted}: parameter {name!r} annotated {code_ann!r} in the code, {doc_ann!r} documented"
            )
    if not inspect.isclass(obj):
        doc_ret, code_ret = _norm_annotation(returns), _actual_annotation(actual.return_annotation)
        if doc_ret != code_ret:
            problems.append(f"{dotted}: returns {code_ret!r} in the code, {doc_ret!r} documented")
    return problems


def check_signatures(text: str) -> list[str]:
    return [problem for line in signature_lines(text) for problem in check_signature_line(line)]


def test_design_doc_exists_with_signature_blocks() -> None:
    assert DESIGN.is_file(), "docs/design.md is the design document"
    assert len(documented_signatures()) >= 40


def test_every_documented_signature_matches_the_code() -> None:
    problems = [p for path in doc_files() for p in check_signatures(path.read_text())]
    assert not problems, "\n".join(problems)


def test_each_callable_is_documented_once() -> None:
    names = [parse_signature_line(line)[0] for line in documented_signatures()]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"documented more than once: {repeated}"


def _public_methods(cls: type) -> list[str]:
    return [
        name
        for name in dir(cls)
        if not name.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, name, None))
    ]


@pytest.mark.parametrize(
    ("prefix", "cls"),
    [
        ("ulakv.Pool", TieredPool),
        ("ulakv.engine.SparseKV", SparseKV),
        ("ulakv.engine.GroupStep", GroupStep),
        ("ulakv.transfer.TransferPlan", TransferPlan),
    ],
)
def test_every_public_method_has_a_signature_line(prefix: str, cls: type) -> None:
    documented = {parse_signature_line(line)[0] for line in documented_signatures()}
    missing = [f"{prefix}.{name}" for name in _public_methods(cls) if f"{prefix}.{name}" not in documented]
    assert not missing, f"public calls without a signature line in docs/: {missing}"
    assert prefix in documented, f"{prefix} itself has no signature line"


# -- the checker fails when it should ----------------------------------------------------------------


def _doctor(text: str, old: str, new: str) -> str:
    assert old in text, f"{old!r} is not in the document"
    return text.replace(old, new, 1)


def test_a_renamed_parameter_fails(tmp_path: Path) -> None:
    line = next(x for x in signature_lines(DESIGN.read_text()) if x.startswith("ulakv.Pool.prepare("))
    copy = tmp_path / "design.md"
    copy.write_text(_doctor(DESIGN.read_text(), line, line.replace("topk:", "top_k:")))
    problems = check_signatures(copy.read_text())
    assert problems and all("ulakv.Pool.prepare" in p for p in problems), problems
    assert any("top_k" in p for p in problems)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("ulakv.Pool.prepare(self, group: int, top_k: torch.Tensor) -> Selection", "top_k"),
        ("ulakv.Pool.prepare(self, topk: torch.Tensor, group: int) -> Selection", "parameters"),
        ("ulakv.Pool.prepare(self, group: int, topk: torch.Tensor) -> TransferPlan", "returns"),
        ("ulakv.Pool.prepare(self, group: str, topk: torch.Tensor) -> Selection", "annotated"),
        ("ulakv.Pool.extend(self, seq: Sequence, num_tokens: int = 2) -> torch.Tensor", "defaults to 1"),
        ("ulakv.Pool.extend(self, seq: Sequence, *, num_tokens: int = 1) -> torch.Tensor", "keyword-only"),
        (
            "ulakv.Pool.run(self, plan: TransferPlan, until: Phase = Phase.IN, "
            "in_layers: range | None = None) -> None",
            "until",
        ),
        (
            "ulakv.Tiered(gpu_slots: int, cpu_slots: int = 0, policy: PolicyConfig = PBLRU(), "
            "staging_slots: int | None = None)",
            "policy",
        ),
        ("ulakv.Pool.prepare_all(self, group: int) -> Selection", "ulakv.Pool.prepare_all"),
        ("ulakv.engine.SparseKVv(pool: TieredPool)", "ulakv.engine.SparseKVv"),
        ("ulakv.Pool.prepare self, group", "not a Python signature"),
    ],
)
def test_a_doctored_line_fails_naming_what_changed(line: str, says: str) -> None:
    problems = check_signature_line(line)
    assert problems, f"accepted: {line}"
    assert any(says in p for p in problems), problems


def test_the_documented_lines_pass_and_tensor_reads_as_torch_tensor() -> None:
    assert check_signature_line("ulakv.Pool.read(self, layer: int, addrs: Tensor) -> Tensor") == []
    assert check_signature_line("ulakv.Pool(config: PoolConfig)") == []


# --------------------------------------------------------------------------------------------------
# public names


@pytest.mark.parametrize(
    "module", [ulakv, ulakv.layouts, ulakv.policies, ulakv.engine], ids=lambda m: m.__name__
)
def test_every_exported_name_is_in_the_design_document(module) -> None:
    text = "\n".join(p.read_text() for p in doc_files())
    missing = [name for name in module.__all__ if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text)]
    assert not missing, f"{module.__name__}.__all__ names missing from docs/: {missing}"


# --------------------------------------------------------------------------------------------------
# layering


def _layer_table(text: str) -> dict[str, int]:
    """Module paths (relative to ``ulakv/``; a trailing ``/`` is a package) -> layer, from the rows
    of the table under '### Layers' whose first cell is a number."""
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    table: dict[str, int] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        for path in re.findall(r"`([\w/]+(?:\.py|/))`", cells[2]):
            assert path not in table, f"{path} is in two rows of the layering table"
            table[path] = int(cells[0])
    return table


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "ulakv").rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ulakv modules that ``name`` imports (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "ulakv"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ulakv":
                continue
            for alias in node.names:  # a submodule imported by name, else the module itself
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return found


def layering_problems(design_text: str) -> list[str]:
    """Every import of a ``ulakv`` module from a row above its own in the layering table of
    ``design_text``, and every module the table leaves out."""
    table = _layer_table(design_text)
    modules = _modules()

    def listed_layer(name: str) -> int | None:
        rel = modules[name].relative_to(ROOT / "ulakv").as_posix()
        if rel in table:
            return table[rel]
        packages = [p for p in table if p.endswith("/") and rel.startswith(p)]
        return table[max(packages, key=len)] if packages else None

    unlisted = [
        name for name, path in modules.items() if path.name != "__init__.py" and listed_layer(name) is None
    ]
    if unlisted:
        return [f"{name} is not in the layering table of docs/design.md" for name in unlisted]
    layers: dict[str, int] = {}

    def layer(name: str, seen: tuple = ()) -> int:
        """A listed module's row; a package ``__init__`` that only re-exports takes the highest row
        of what it imports."""
        if name not in layers:
            found = listed_layer(name)
            if found is None:
                deps = [d for d in _imports(name, modules[name], modules) if d not in seen and d != name]
                found = max((layer(d, (*seen, name)) for d in deps), default=0)
            layers[name] = found
        return layers[name]

    upward = []
    for name, path in modules.items():
        if path.name == "__init__.py" and listed_layer(name) is None:
            continue  # a re-exporting package: placed by what it imports
        for dep in sorted(_imports(name, path, modules)):
            if layer(dep) > layer(name):
                upward.append(f"{name} (layer {layer(name)}) imports {dep} (layer {layer(dep)})")
    return upward


def test_the_layering_table_holds_for_every_import() -> None:
    problems = layering_problems(DESIGN.read_text())
    assert not problems, "imports against the layering of docs/design.md:\n" + "\n".join(problems)


def test_the_layering_check_fails_on_an_upward_import_or_a_missing_module() -> None:
    text = DESIGN.read_text()
    lowered = _doctor(text, "| 5 | the factory | `pool.py`", "| 1 | the factory | `pool.py`")
    problems = layering_problems(lowered)
    assert any(p.startswith("ulakv.pool (layer 1) imports ulakv.layouts") for p in problems), problems
    dropped = _doctor(text, "`transfer.py`, ", "")
    assert layering_problems(dropped) == ["ulakv.transfer is not in the layering table of docs/design.md"]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph`` (module -> modules it imports), one path per circle found by
    a depth-first search: ``[a, b, ..., a]``."""
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep, 2) == 1:
                cycles.append([*path[path.index(dep) :], dep])
            elif state.get(dep, 2) == 0:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node)
    return cycles


def test_no_import_circle_in_ulakv() -> None:
    """Function-level imports included: a lazy import back up the layers is still a circle."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) - {name} for name, path in modules.items()}
    assert import_cycles(graph) == [], "import circles in ulakv/"


def test_the_circle_check_finds_a_planted_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) - {name} for name, path in modules.items()}
    graph["ulakv.layouts.striped"] = graph["ulakv.layouts.striped"] | {"ulakv.pool"}  # as it was
    circles = import_cycles(graph)
    assert len(circles) == 1 and set(circles[0]) == {"ulakv.layouts.striped", "ulakv.pool"}, circles


# --------------------------------------------------------------------------------------------------
# links and references


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces -> '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(text: str) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", _without_code(text), flags=re.M)}


def _links(text: str) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", _without_code(text))


def link_problems(text: str, base: Path) -> list[str]:
    """Links of a markdown ``text`` that lives in folder ``base`` that leave the repository, name a
    file it lacks, or an anchor its target lacks. http(s) links are not followed."""
    bad = []
    for link in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, flags=re.I):
            if not link.startswith(("http://", "https://")):
                bad.append(f"{link}: only http(s) links may leave the repository")
            continue
        target, _, anchor = link.partition("#")
        dest = (base / target).resolve() if target else None
        if dest is not None and (not dest.is_relative_to(ROOT) or not dest.is_file()):
            bad.append(f"{link}: no such file in the repository")
            continue
        if anchor and (dest is None or dest.suffix == ".md"):
            headings = _anchors(text if dest is None else dest.read_text())
            if anchor not in headings:
                bad.append(f"{link}: no heading #{anchor} there")
    return bad


@pytest.mark.parametrize("path", [ROOT / "README.md", *doc_files()], ids=lambda p: p.name)
def test_every_link_resolves_inside_the_repository(path: Path) -> None:
    bad = link_problems(path.read_text(), path.parent)
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_link_check_fails_on_links_out_of_the_repository() -> None:
    text = (
        "[a](" + "../" + "shared/DESIGN.md) [b](docs/nothing.md) [c](docs/design.md#no-such-heading) "
        "[d](file:///etc/passwd) [e](#nowhere) [f](docs/design.md#4-invariants) [g](https://example.org)"
    )
    problems = link_problems(text, ROOT)
    assert [p.split(":")[0] for p in problems] == [
        "../" + "shared/DESIGN.md",
        "docs/nothing.md",
        "docs/design.md#no-such-heading",
        "file",
        "#nowhere",
    ], problems


def test_the_readme_points_at_the_design_document() -> None:
    assert "docs/design.md" in _links((ROOT / "README.md").read_text())


TEXT_SUFFIXES = {".md", ".py", ".txt", ".toml", ".json", ".yml", ".yaml", ".cfg", ".ini", ".rst"}


def _texts() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("docs", "ulakv", "benchmarks"):
        files += [
            p
            for p in sorted((ROOT / folder).rglob("*"))
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
        ]
    return files


def test_no_text_points_outside_the_repository() -> None:
    outside = ("../" + "shared", "/" + "work/")  # split so this file never matches itself
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _texts()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(s in line for s in outside)
    ]
    assert not found, "references outside the repository:\n" + "\n".join(found)


# -- developer tools stay out of the package -----------------------------------------------------------
def tool_imports(package: Path) -> list[str]:
    """Every import of the repository's ``tools`` (developer and CI tooling) from a module under
    ``package``, function-level imports included: ``module: line``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "tools" or n.startswith("tools.") for n in names):
                found.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}")
    return found


def test_the_package_imports_no_developer_tool() -> None:
    assert tool_imports(ROOT / "ulakv") == []
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ulakv, ulakv.cli, ulakv.integrations.sglang, ulakv.integrations.sglang.plugin;"
            "print(sorted(m for m in sys.modules if m == 'tools' or m.startswith('tools.')))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_the_tool_import_check_finds_a_planted_import(tmp_path: Path) -> None:
    package = tmp_path / "ulakv"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "spy.py").write_text(
        "def f():\n    from tools.critical_path import critical_path\n"
    )
    (package / "fine.py").write_text("import toolz\nfrom .tools import x\n")
    assert tool_imports(package) == ["ulakv/kernels/spy.py:2"]


# -- no module reads another module's private attributes ------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reads(package: Path, owners: tuple[Path, ...] = ()) -> list[str]:
    """Every ``obj._name`` in a module of ``package`` where ``obj`` is not ``self``, ``cls`` or
    ``super()`` and ``_name`` is a private attribute or method that classes of *other* modules
    define (a method, a class-level name, or ``self._name = ...``; the modules of ``package`` and
    of ``owners``) and this module does not: ``module:line: expression``. Another library's
    privates (``torch._C``) are not ours."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(package.rglob("*.py"))}
    scanned = dict(trees)
    for owner in owners:
        trees.update({path: ast.parse(path.read_text()) for path in sorted(owner.rglob("*.py"))})
    defined: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.append(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.append(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names += [t.id for t in item.targets if isinstance(t, ast.Name)]
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.append(node.attr)
            for name in names:
                if _private(name):
                    defined.setdefault(name, set()).add(path)
    found = []
    for path, tree in scanned.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if path not in defined.get(node.attr, {path}):
                rel = path.relative_to(package.parent).as_posix()
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_attributes() -> None:
    """The package's own modules talk through public names (``Pool.memory()``, ``Sequence.runs``,
    ``layouts.tiered.take_exact`` and the other slice functions, ``transfer.interrupt_of``)."""
    assert private_reads(ROOT / "ulakv") == []


def test_tests_and_benchmarks_read_the_packages_privates_only_through_the_testing_hook() -> None:
    """``pool.internals()`` (``ulakv.frame.Internals``) is the one way a test or a benchmark sees
    what a pool keeps."""
    for where in ("tests", "benchmarks"):
        assert private_reads(ROOT / where, owners=(ROOT / "ulakv",)) == [], where


def test_the_private_read_check_finds_a_planted_read(tmp_path: Path) -> None:
    package = tmp_path / "ulakv"
    package.mkdir()
    (package / "owner.py").write_text(
        "class Pool:\n    def __init__(self):\n        self._state = 1\n\n"
        "    def peek(self, other):\n        return other._state + self._state\n"  # same module: fine
    )
    (package / "reader.py").write_text(
        "import torch\n\n\ndef bytes_of(pool):\n    torch._C  # another library's: not ours\n"
        "    return pool._state\n"
    )
    assert private_reads(package) == ["ulakv/reader.py:6: pool._state"]
