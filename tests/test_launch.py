"""launch: the same per-rank function on simulated ranks and on torchrun processes."""

import re
import time

import pytest

from cpbook.core.launch import Nodes, run
from cpbook.demos.ch01_merge import merge_rank
from tests.rank_fns import block_on_rank, echo_timeout, fail_on_rank, kill_on_rank


@pytest.mark.parametrize(
    "backend", ["inline", pytest.param("torchrun", marks=pytest.mark.torchrun)]
)
def test_four_ranks_return_their_results(backend, capsys):
    res = run(merge_rank, 4, fn_kwargs=dict(num_keys=10), backend=backend, dist_backend="gloo")
    assert [r["keys"] for r in res] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert max(r["max_abs_err"] for r in res) <= 1e-10
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("inline: 4 ranks" if backend == "inline" else "torchrun: 4 ranks, gloo")
    assert printed[1] == "[rank 0] keys [0, 3): 3 of 10; merged == dense: True"
    assert printed[-1].startswith("rank 3 comm: all_gather[world] x2")


@pytest.mark.parametrize(
    "backend", ["inline", pytest.param("torchrun", marks=pytest.mark.torchrun)]
)
def test_failing_rank_raises_with_its_traceback(backend):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run(
            fail_on_rank,
            4,
            fn_kwargs=dict(bad=2),
            backend=backend,
            dist_backend="gloo",
            report=False,
        )
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    first = msg.splitlines()[0]
    assert first.startswith("rank 2 of 4 failed in fail_on_rank")
    assert first.endswith(": ValueError: deliberate failure on rank 2")  # the cause, one line
    assert "Traceback" in msg


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (kill_on_rank, "ended without a result or a Python error: killed by signal 9 (SIGKILL)"),
        (
            block_on_rank,
            "waited for rank(s) [2] in all_reduce #2 on group 'world' [0, 1, 2] (timeout 5 s); "
            "they never entered it, ranks [0, 1] did",
        ),
    ],
    ids=["sigkill", "blocks"],
)
def test_a_killed_or_silent_rank_is_the_one_named(fn, says):
    """Rank 2 of 3 is SIGKILLed after a first all-reduce, or stops answering (waits outside
    any collective): the error's first line names rank 2 and the signal, or the call its peers
    waited in for it (not the peer that timed out first).  Nothing hangs: the 5 s collective
    timeout ends the job (pytest-timeout fails a hang; no clock is asserted)."""
    with pytest.raises(RuntimeError) as err:
        run(fn, 3, "torchrun", {"victim": 2}, timeout=5, dist_backend="gloo", report=False)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"rank 2 of 3 failed in {fn.__name__} under torchrun: "), first
    assert says in first, first
    if fn is block_on_rank:  # the peer that timed out says whom it waited for
        assert re.search(r"under torchrun: stopped answering: rank [01] waited", first), first


def test_a_silent_simulated_rank_is_the_one_named():
    """Inline, the same fault: rank 2's thread stops answering; its peers' barrier times out
    (1 s) and the run names rank 2, not the peer that timed out first."""
    with pytest.raises(RuntimeError) as err:
        run(block_on_rank, 3, "inline", {"victim": 2, "block_s": 30}, timeout=1, report=False)
    first = str(err.value).splitlines()[0]
    assert first == (
        "rank 2 of 3 failed in block_on_rank: stopped answering: ranks [0, 1] timed out or "
        "gave up waiting (timeout 1 s) while rank(s) [2] never returned"
    )


def test_notebook_functions_are_rejected_for_torchrun():
    def local(ctx):
        return ctx.rank

    with pytest.raises(ValueError, match="importable-fn"):
        run(local, 2, backend="torchrun", report=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="launch-backend"):
        run(merge_rank, 2, backend="mpi")
    with pytest.raises(ValueError, match="world-size"):
        run(merge_rank, 0)


@pytest.mark.parametrize(
    "backend", ["inline", pytest.param("torchrun", marks=pytest.mark.torchrun)]
)
def test_function_arguments_are_kept_apart_from_launcher_options(backend):
    """A per-rank function may take a ``timeout`` of its own: it arrives through fn_kwargs."""
    res = run(
        echo_timeout,
        2,
        backend,
        {"timeout": 7, "threads": 3},
        timeout=30,
        dist_backend="gloo",
        report=False,
    )
    assert res == [(7, 3), (7, 3)]


def test_nodes_spell_the_torchrun_flags():
    """The multi-node form (run by tests/test_multinode.py) and its argument checks."""
    assert Nodes(2, 1, "127.0.0.1:29500").torchrun_args(2) == [
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29500",
        "--nproc-per-node=2",
    ]
    with pytest.raises(ValueError, match="node-rank"):
        Nodes(2, 2, "127.0.0.1:29500")
    with pytest.raises(ValueError, match="rdzv-endpoint"):
        Nodes(2, 0, "127.0.0.1")
    with pytest.raises(ValueError, match="nodes-world"):
        run(merge_rank, 3, "torchrun", nodes=Nodes(2, 0, "127.0.0.1:29500"), report=False)
