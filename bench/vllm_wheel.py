"""One place that fetches a vLLM release's source for the benches that read or run it.

    from vllm_wheel import source_dir
    root = source_dir("0.34.0")      # .../vllm-0.34.0/ holding the package folder vllm/

Downloads the wheel with ``pip download --no-deps`` (never installs it) into
``$CPBOOK_VLLM_CACHE`` (default ``~/.cache/cpbook/vllm``), unzips its Python files once, and
returns the folder that holds ``vllm/``.  Put that folder first on ``sys.path`` to import
vLLM's pure-Python modules (config classes, argument parser) on a CPU; modules that load
vLLM's compiled kernels are not importable this way.  A bench, not a test: it needs the
package registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ANCHOR_RELEASE = "0.34.0"


def cache_root() -> Path:
    """The folder wheels and their unpacked sources live in."""
    default = Path.home() / ".cache" / "cpbook" / "vllm"
    return Path(os.environ.get("CPBOOK_VLLM_CACHE", default))


def wheel_path(version: str) -> Path:
    """The downloaded wheel of vLLM ``version`` (downloaded on first use, never installed)."""
    folder = cache_root() / "wheels"
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        subprocess.run([*cmd, "-d", str(folder), f"vllm=={version}"], check=True)
        found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    return found[0]


def source_dir(version: str) -> Path:
    """The folder holding vLLM ``version``'s ``vllm/`` package (Python files only)."""
    root = cache_root() / f"vllm-{version}"
    if not (root / "vllm" / "__init__.py").exists():
        with zipfile.ZipFile(wheel_path(version)) as whl:
            names = [n for n in whl.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            whl.extractall(root, members=names)
    return root
