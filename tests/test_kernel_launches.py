"""Every Triton launch in the package passes its arguments by keyword.

The planning kernels take 40-60 runtime arguments (``apply_kernel`` 56). Passed by position, a
parameter added, removed or reordered in a kernel's signature would shift every argument after it
into the wrong slot, and most would still be tensors or ints Triton accepts. By keyword, Triton
refuses a name the signature lacks or a parameter left without a value, at the first launch.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

from triton.runtime.jit import KernelInterface

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ulakv"


def positional_launches(source: str, namespace: dict) -> list[str]:
    """``kernel[grid](...)`` calls in ``source`` whose kernel (a name in ``namespace`` that is a
    Triton kernel) gets a positional or ``*``-unpacked argument: ``"name:line"`` each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        target = node.func.value
        if (
            isinstance(target, ast.Name)
            and isinstance(namespace.get(target.id), KernelInterface)
            and node.args
        ):
            found.append(f"{target.id}:{node.lineno}")
    return found


def _modules() -> list[tuple[Path, ModuleType]]:
    """Every module of the package that launches something (``](`` in its source), imported."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "](" not in path.read_text():
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((path, importlib.import_module(name)))
    return out


def test_every_launch_passes_arguments_by_keyword() -> None:
    modules = _modules()
    kernels = {
        name
        for _, module in modules
        for name, obj in vars(module).items()
        if isinstance(obj, KernelInterface)
    }
    assert {"apply_kernel", "classify_kernel", "claim_kernel", "compact_kernel"} <= kernels, kernels
    found = {
        str(path.relative_to(ROOT)): bad
        for path, module in modules
        if (bad := positional_launches(path.read_text(), vars(module)))
    }
    assert not found, f"launches with positional arguments: {found}"


def test_the_check_finds_a_positional_launch() -> None:
    from ulakv.kernels import gather

    planted = "gather_kernel[(1,)](addrs, n=1, ROWS=4)\ngather_kernel[(1,)](*args)\nother[(1,)](x)\n"
    assert positional_launches(planted, vars(gather)) == ["gather_kernel:1", "gather_kernel:2"]
    assert positional_launches("gather_kernel[(1,)](addr_ptr=a, **rest)\n", vars(gather)) == []
