"""``benchmarks/sglang_gpu_check.py`` where SGLang is not installed (every CPU machine): it imports, it
answers ``--help``, and it reports a missing SGLang as a failed check with a plain reason and exit code 1
instead of crashing. What it checks needs a CUDA machine with SGLang; this keeps the script from rotting.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sglang_gpu_check.py"
ORDER = [
    "version",
    "conformance",
    "install",
    "kv_pool_roundtrip",
    "flashmla_sparse_decode",
    "coordinator_decode",
    "flashmla_kv_decode",
    "decode_step_graph",
    "allocator",
    "dcp_hooks",
    "dcp_localize",
]
GPU_ONLY = ("sglang", "sgl_kernel", "flash_mla")

needs_no_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="sglang is installed here: the script would run it"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """The script as a person runs it, with this environment's python (the venv's under ``make test``)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def script() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("sglang_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_imports_nothing_of_sglang_at_module_level(script: ModuleType) -> None:
    """Every import of SGLang and its CUDA packages is inside a check (the module imported above, with
    no SGLang here); the checks are the documented ones, in order."""
    tree = ast.parse(SCRIPT.read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    top += [n for s in tree.body if isinstance(s, ast.If) for n in s.body if isinstance(n, ast.Import)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in GPU_ONLY], names
    assert list(script.CHECKS) == ORDER
    assert all(f"``{name}``" in (script.__doc__ or "") for name in ORDER)


def test_help() -> None:
    done = _run("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--out", "--checks", *ORDER):
        assert word in done.stdout


@needs_no_sglang
def test_version_check_fails_plainly_without_sglang(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = _run("--checks", "version", "--out", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith(("PASS", "FAIL", "SKIP")))
    assert line.split()[:2] == ["FAIL", "version"]
    assert "sglang is not installed" in line
    results = json.loads(out.read_text())
    [check] = results["checks"]
    assert check["name"] == "version" and check["status"] == "FAIL"
    assert "sglang is not installed" in check["reason"] and check["seconds"] >= 0
    assert results["ok"] is False and results["counts"] == {"PASS": 0, "FAIL": 1, "SKIP": 0}
    assert "| version | FAIL |" in done.stdout  # the block for benchmarks/RESULTS.md


@needs_no_sglang
def test_a_failed_check_does_not_stop_the_next(script: ModuleType, tmp_path: Path, capsys) -> None:
    """Checks run in suite order whatever order they are asked in; each failure is reported."""
    out = tmp_path / "results.json"
    assert script.main(["--checks", "kv_pool_roundtrip,version,install", "--out", str(out)]) == 1
    results = json.loads(out.read_text())
    assert [c["name"] for c in results["checks"]] == ["version", "install", "kv_pool_roundtrip"]
    assert all(c["status"] == "FAIL" and "sglang is not installed" in c["reason"] for c in results["checks"])
    assert "Traceback" in capsys.readouterr().out


def test_unknown_check_is_a_usage_error(script: ModuleType, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        script.main(["--checks", "version,no_such_check"])
    assert exc.value.code == 2
    assert "no_such_check" in capsys.readouterr().err
