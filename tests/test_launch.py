"""launch: the same per-rank function on simulated ranks and on torchrun processes."""
import subprocess
import sys
import time

import pytest

from cpbook.demos import sharded_keys_attention
from cpbook.launch import run
from tests.rank_fns import fail_on_rank


@pytest.mark.parametrize("backend", ["inline", "torchrun"])
def test_four_ranks_return_their_results(backend, capsys):
    res = run(sharded_keys_attention, 4, backend=backend, num_keys=10)
    assert [r["keys"] for r in res] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("inline: 4 ranks" if backend == "inline" else "torchrun: 4 ranks, gloo")
    assert printed[1] == "[rank 0] keys [0, 3): 3 of 10; merged == dense: True"
    assert printed[-1].startswith("rank 3 comm: all_gather[world] x2")


@pytest.mark.parametrize("backend", ["inline", "torchrun"])
def test_failing_rank_raises_with_its_traceback(backend):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run(fail_on_rank, 4, backend=backend, bad=2, report=False)
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert msg.startswith("rank 2 of 4 failed in fail_on_rank")
    assert "Traceback" in msg and "ValueError: deliberate failure on rank 2" in msg


def test_notebook_functions_are_rejected_for_torchrun():
    def local(ctx):
        return ctx.rank
    with pytest.raises(ValueError, match="importable-fn"):
        run(local, 2, backend="torchrun", report=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="launch-backend"):
        run(sharded_keys_attention, 2, backend="mpi")
    with pytest.raises(ValueError, match="world-size"):
        run(sharded_keys_attention, 0)


def test_cli_inline_and_under_torchrun():
    out = subprocess.run([sys.executable, "-m", "cpbook", "demo", "merge", "--world-size", "3",
                          "--param", "num_keys=2"], capture_output=True, text=True, check=True).stdout
    assert "[rank 2] keys [0, 0): 0 of 2; merged == dense: True" in out
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "cpbook", "demo", "merge"],
                         capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout
    assert out.startswith("torchrun: 2 ranks, gloo\n[rank 0] keys [0, 32)")
    listing = subprocess.run([sys.executable, "-m", "cpbook", "demo", "--list"],
                             capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("merge ") for line in listing.splitlines())
