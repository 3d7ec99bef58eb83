"""cpbook.tools.gpu_smoke: the one-GPU smoke run, dry-run on the CPU (gloo, no GPU needed)."""

from __future__ import annotations

import json

import pytest

from cpbook.demos import DEMOS as REGISTERED
from cpbook.tools.gpu_smoke import ATTENTION, DEMOS, main

pytestmark = [pytest.mark.torchrun, pytest.mark.usefixtures("one_torch_thread")]


def test_the_dry_run_passes_every_check(capsys):
    assert main(["--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by = {}
    for row in rows:
        by.setdefault(row["name"], []).append(row)
    assert by["gpu_smoke_summary"] == [
        {
            "name": "gpu_smoke_summary",
            "device": "cpu",
            "checks": len(rows) - 1,
            "failed": [],
            "ok": True,
        }
    ]
    assert all(row["ok"] for row in rows)
    assert len(by["gpu_smoke_attention"]) == 2 * len(ATTENTION)
    demos = {row["case"] for row in by["gpu_smoke_demo"]}
    assert demos == set(REGISTERED) | {"engine-grid"} == {d for d, _, _ in DEMOS} | {"engine-grid"}
    assert all(row["gpu_bytes"] is None for row in by["gpu_smoke_demo"])  # no GPU in a dry run
    assert [row["case"] for row in by["gpu_smoke_dist"]] == [
        "TorchGroup primitives",
        "demo merge --backend torchrun",
        "torchrun -m cpbook serve",
    ]
