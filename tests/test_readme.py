"""The README's usage example runs as written, and its install commands are safe."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    stats = namespace["pool"].stats()
    assert stats["live_addresses"] == 0 and stats["physical_slots_used"] == 0
    assert stats["hits"] + stats["misses"] > 0


def test_the_pip_install_paths_are_as_safe_as_the_makefile() -> None:
    """A pip user gets the Makefile's pinned torch built for the CPU in one command, or keeps their own
    torch; neither pulls an unpinned CUDA build (``pyproject.toml`` asks only ``torch>=2.4``)."""
    root = README.parent
    readme = README.read_text()
    makefile_torch = re.search(r"^TORCH \?= (\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    lines = [
        line.strip()
        for line in (root / "requirements" / "cpu.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == ["--extra-index-url https://download.pytorch.org/whl/cpu", makefile_torch, "-e .[test]"]
    assert "pip install -r requirements/cpu.txt" in readme
    keep = re.search(r"pip install -e \"\.\[test\]\" -c <\(pip freeze \| grep -iE '(.+)'\)", readme)
    assert keep, "the README's own-torch command"
    pattern = re.compile(keep.group(1))
    frozen = [
        "torch==2.8.0+cu128",
        "triton==3.4.0",
        "torch @ file:///wheels/torch.whl",
        "torchvision==0.2",
        "tqdm==4",
    ]
    assert [line for line in frozen if pattern.search(line)] == frozen[:3]
