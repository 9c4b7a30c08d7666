"""The pinned SGLang wheel's Python source, fetched once into a cache, for reading and for a few kernels.

The SGLang adapter is written against one SGLang release. Its conformance checks read that release's
source (never importing the ``sglang`` package, whose ``__init__`` needs CUDA-only dependencies), and
tests load single dependency-free files of it (``transform_index.py``) by path. This module fetches
the wheel with pip, keeps only its ``.py`` files in a cache directory and hands back that directory.

Cache: ``<repo>/.cache/sglang-<version>/`` unless the environment variable ``ULAKV_SGLANG_CACHE``
names another directory. A ``.ready`` file marks a complete extraction (``make test`` depends on it).
``python -m tools.sglang_wheel`` fetches and prints the path.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

from ulakv.integrations.sglang.version import SGLANG_VERSION

__all__ = ["SGLANG_VERSION", "load_transform_index", "main", "wheel_source"]


#: The one binary wheel that release ships; pinning its tags lets any interpreter or host fetch the
#: same file (only its Python source is read, never its compiled parts).
_WHEEL_TAGS = ("--python-version", "3.11", "--implementation", "cp", "--abi", "cp311")
_WHEEL_PLATFORM = ("--platform", "manylinux_2_34_x86_64")

_REPO = Path(__file__).resolve().parents[1]
_READY = ".ready"
_TRANSFORM_INDEX = Path("sglang/kernels/ops/attention/dsa/transform_index.py")


def default_cache() -> Path:
    """The cache directory: ``$ULAKV_SGLANG_CACHE`` when set, else ``<repo>/.cache/sglang-<version>``."""
    env = os.environ.get("ULAKV_SGLANG_CACHE")
    return Path(env) if env else _REPO / ".cache" / f"sglang-{SGLANG_VERSION}"


def _pip_command(dest: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"sglang=={SGLANG_VERSION}",
        "--no-deps",
        "--only-binary=:all:",
        *_WHEEL_TAGS,
        *_WHEEL_PLATFORM,
        "-d",
        str(dest),
    ]


def _download_and_extract(dest: Path) -> None:
    """Download the wheel into a scratch folder and extract its ``sglang/**/*.py`` files into ``dest``."""
    with tempfile.TemporaryDirectory(prefix="sglang-wheel-", dir=dest.parent) as scratch:
        cmd = _pip_command(Path(scratch))
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(Path(scratch).glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the SGLang {SGLANG_VERSION} wheel (exit code {proc.returncode}).\n"
                f"command: {' '.join(cmd)}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")]
            if not members:
                raise RuntimeError(f"{wheels[0].name} holds no sglang/**/*.py files")
            for name in members:
                zf.extract(name, dest)


def wheel_source(cache: Path | None = None) -> Path:
    """The directory holding the pinned wheel's extracted ``sglang/`` package (its ``.py`` files only).

    Downloads and extracts on first use; later calls return at once. Concurrent callers (pytest-xdist
    workers) serialise on a lock file, and the extraction lands under its final name only once whole.
    Raises RuntimeError, with the pip command and its output, when the download fails.
    """
    cache = Path(cache) if cache is not None else default_cache()
    if (cache / _READY).is_file():
        return cache
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cache / _READY).is_file():  # another process finished while we waited
            return cache
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
        try:
            _download_and_extract(staging)
            (staging / _READY).write_text(f"sglang=={SGLANG_VERSION}\n")
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is plain shared source
            if cache.exists():  # never ours (ours appears whole, by rename): an empty folder is fine
                if any(cache.iterdir()):
                    raise RuntimeError(f"{cache} exists without {_READY} and is not empty: remove it")
                cache.rmdir()
            staging.rename(cache)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return cache


def load_transform_index(source: Path) -> ModuleType:
    """Load ``sglang/kernels/ops/attention/dsa/transform_index.py`` of ``source`` as a standalone module.

    The file imports only torch, triton and the standard library, so it loads by path without the
    ``sglang`` package. Each source directory gets its own module (registered in ``sys.modules``, which
    Triton's source inspection wants); loading the same file twice returns the first module.
    """
    path = (Path(source) / _TRANSFORM_INDEX).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {source} an extracted SGLang source tree?")
    name = f"sglang_{SGLANG_VERSION.replace('.', '_')}_transform_index"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__ or "").resolve() == path:
        return loaded
    if loaded is not None:  # another source tree: keep both apart
        name = f"{name}_{abs(hash(str(path))):x}"
        if name in sys.modules:
            return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def main() -> None:
    """Fetch the pinned wheel into the cache (if needed) and print the source directory."""
    print(wheel_source())


if __name__ == "__main__":
    main()
