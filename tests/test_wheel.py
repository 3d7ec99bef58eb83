"""The built wheel works on its own: installed into a fresh venv and run outside the checkout.

The test builds ``cpbook``'s wheel (``pip wheel --no-deps --no-build-isolation --no-index``, so
it needs only the setuptools already in this venv and no network), installs it into a new
venv and, from a folder outside the checkout, imports the installed copy and runs one demo
inline, :meth:`cpbook.dynamic.router.Router.measured` and the calibration fit, so the stored
runs are read from the wheel's package data (:mod:`cpbook.data`).

How the new venv gets the heavy dependencies without the checkout:

* The wheel is built from a copy of the source (the top-level files and ``cpbook/``) in a tmp
  folder, not in place: an in-place setuptools build writes ``build/`` and ``*.egg-info/``
  into the working tree that others are editing.
* ``python -m venv --without-pip`` makes the venv *without* system site packages; this
  interpreter's pip installs the wheel into it (``pip --python <new python> install
  --no-deps``), so no pip is bootstrapped and nothing is downloaded.
* Only then, a ``.pth`` file in the new site-packages names this interpreter's site-packages
  (torch, numpy, matplotlib, ipywidgets).  A path line in a ``.pth`` file only appends that
  folder to ``sys.path``, after the new site-packages; the ``.pth`` files *inside* it are not
  processed, so the editable install's ``__editable__`` finder is never installed and the
  wheel's ``cpbook`` is the one found.  The child runs with ``python -I`` (no ``PYTHON*``
  variables, no script or working folder on ``sys.path``) from a tmp folder, and asserts that
  ``cpbook`` and its data come from the new venv and that the checkout's root is not on
  ``sys.path`` (a venv inside the checkout, as CI's ``.venv``, may supply the dependencies).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120

CHECK = r"""
import json, math, sys
from importlib import resources
from pathlib import Path

venv, root = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
expected = json.loads(Path(sys.argv[3]).read_text())

def inside(path, folder):
    return Path(path).resolve().is_relative_to(folder)

import cpbook
import cpbook.data
assert inside(cpbook.__file__, venv), f"cpbook imported from {cpbook.__file__}, not {venv}"
# the checkout's source may not be importable (its own .venv, as in CI, may hold the deps)
on_path = [p for p in sys.path if p and Path(p).resolve() == root]
assert not on_path, f"checkout on sys.path: {sys.path}"
data = resources.files("cpbook.data")
for name in cpbook.data.STORED:
    assert inside(str(data.joinpath(name)), venv), f"{name} read from {data}"
    assert cpbook.data.stored_text(name) == expected["texts"][name], f"{name} differs"
for name, path in cpbook.data.HF_CONFIGS.items():
    assert inside(path, venv), f"{name}'s config.json read from {path}"
    assert cpbook.data.hf_config_json(name) == expected["hf_configs"][name], f"{name} differs"

from cpbook.core.launch import run
from cpbook.demos import get_demo

res = run(get_demo("merge"), 2, backend="inline", report=False)
assert inside(sys.modules[get_demo("merge").__module__].__file__, venv)
errs = [r["max_abs_err"] for r in res]
assert len(errs) == 2 and all(e <= 1e-10 for e in errs), f"merge max_abs_err {errs}"

from cpbook.dynamic.router import Router

for tpa, key in ((False, "dcp_tokens"), (True, "dcp_tpa_tokens")):
    r = Router.measured(tpa=tpa)
    want = [float(expected["break_even"][key])]
    assert r.thresholds == want, f"Router.measured(tpa={tpa}).thresholds {r.thresholds} != {want}"
    assert r.cp_sizes == [1, expected["break_even"]["ranks"]], r.cp_sizes

from cpbook.costmodel.calibration import calibrate, load_points

points = load_points()
fit, held_out = calibrate(points)
consts = [fit.alpha_s, fit.beta_s_per_byte, fit.prefill_flops_per_s, fit.decode_flops_per_s,
          fit.read_bytes_per_s]
assert all(math.isfinite(c) and c > 0 for c in consts), f"fit constants {fit}"
assert held_out and all(math.isfinite(row["error"]) for row in held_out), held_out
print(json.dumps({"cpbook": cpbook.__file__, "merge_err": max(errs), "points": len(points),
                  "fit": consts, "held_out": len(held_out)}))
"""


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; on a non-zero exit fail with its stdout and stderr."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} ran past {TIMEOUT_S} s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    if proc.returncode:
        pytest.fail(
            f"{cmd} exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_checkout(tmp_path):
    pytest.importorskip("setuptools", reason="--no-build-isolation needs setuptools in the venv")
    src = tmp_path / "src"
    src.mkdir()
    for f in ROOT.iterdir():
        if f.is_file():
            shutil.copy2(f, src / f.name)
    shutil.copytree(
        ROOT / "cpbook", src / "cpbook", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    texts = {p.name: p.read_text() for p in (src / "cpbook" / "data").iterdir() if p.is_file()}
    break_even = next(
        json.loads(line)
        for line in texts["decode_step.json"].splitlines()
        if '"decode_break_even"' in line
    )

    whl = tmp_path / "wheelhouse"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run(pip + ["wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index", "-w", whl])
    (wheel,) = whl.glob("cpbook-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run(pip + ["--python", py, "install", "--no-deps", "--no-index", wheel])
    site = _run([py, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    outer = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site.stdout.strip(), "_cpbook_test_deps.pth").write_text("\n".join(sorted(outer)) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "check.py").write_text(CHECK)
    hf_configs = (src / "cpbook" / "data" / "hf_configs").glob("*.json")
    hf = {p.stem: json.loads(p.read_text()) for p in hf_configs}
    expected = {"texts": texts, "break_even": break_even, "hf_configs": hf}
    (work / "expected.json").write_text(json.dumps(expected))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.pop("VIRTUAL_ENV", None)
    proc = _run([py, "-I", "check.py", venv, ROOT, "expected.json"], cwd=work, env=env)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["cpbook"]).resolve().is_relative_to(venv.resolve())
    assert got["merge_err"] <= 1e-10 and got["points"] > 0 and got["held_out"] > 0
