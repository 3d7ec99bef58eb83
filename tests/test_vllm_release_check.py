"""bench/vllm_release_check.py's extraction and comparison, on tiny synthetic "releases" (no
network, no vLLM): a function, a method and a segment inline in a longer function are found
by name, and each status (unchanged, reformatted, changed, missing, new) is told apart."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vllm_release_check.py"
spec = importlib.util.spec_from_file_location("vllm_release_check", BENCH)
rc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = rc  # dataclasses look their module up there
spec.loader.exec_module(rc)
sys.path.remove(str(BENCH.parent))  # the bench put its folder first, for vllm_wheel

BASE = '''
import torch


def helper(x):
    """Doubles."""
    return 2 * x


class Manager:
    @staticmethod
    def split(n, k):
        return [n // k] * k

    def gone(self):
        return 0


def build(sizes):
    world = torch.arange(8)
    # the part the book reproduces
    dcp = sizes
    groups = world.reshape(-1, dcp)
    groups = [g.tolist() for g in groups]
    done = True
    return groups
'''

NEW = '''
import torch


def helper(x):
    """Doubles its argument."""
    return 2 * x  # comment


class Manager:
    @staticmethod
    def split(n, k):
        return [n // k] * (k + 0)

    def fresh(self):
        return 1


def build(sizes):
    world = torch.arange(8)
    dcp = sizes
    groups = world.reshape(-1, dcp)
    groups = [sorted(g.tolist()) for g in groups]
    done = True
    return groups
'''

SEGMENT = rc.Target("m.py", "build", "dcp = sizes", "done = True")


@pytest.fixture
def releases(tmp_path):
    for name, text in (("base", BASE), ("new", NEW)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(text)
    return tmp_path / "base", tmp_path / "new"


def test_extract_function_method_and_segment():
    text, _ = rc.extract(BASE, rc.Target("m.py", "Manager.split"))
    assert text.startswith("@staticmethod\ndef split(n, k):")
    seg, _ = rc.extract(BASE, SEGMENT)
    assert seg.splitlines()[0] == "dcp = sizes" and "done" not in seg and len(seg.splitlines()) == 3
    assert rc.extract(BASE, rc.Target("m.py", "Manager.fresh")) is None
    assert rc.extract(BASE, rc.Target("m.py", "build", "no such line", "done")) is None


@pytest.mark.parametrize(
    "qualname, status",
    [
        ("helper", "reformatted"),  # docstring and comment only
        ("Manager.split", "changed"),
        ("Manager.gone", "missing"),
        ("Manager.fresh", "new"),
        ("nowhere", "absent"),
    ],
)
def test_statuses(releases, qualname, status):
    row = rc.compare(*releases, rc.Target("m.py", qualname))
    assert row["status"] == status and row["qualname"] == qualname


def test_segment_status_and_run(releases):
    assert rc.compare(*releases, SEGMENT)["status"] == "changed"
    same = rc.Target("m.py", "build", "world = torch.arange(8)", "dcp = sizes")
    assert rc.compare(*releases, same)["status"] == "unchanged"
    import torch

    for root, want in zip(releases, ([[0, 1], [2, 3], [4, 5], [6, 7]],) * 2):
        ns = rc.load(root, SEGMENT, {"torch": torch, "world": torch.arange(8), "sizes": 2})
        assert ns["groups"] == want
