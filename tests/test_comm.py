"""comm: both backends move the same data and record the same traces; nothing hangs."""

import time

import pytest
import torch

from cpbook.core.comm import CommRecord, Trace, process_group_timeout_s
from cpbook.core.launch import run
from tests.rank_fns import every_collective, reordered_collectives, skip_collective


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("n", [2, 3, 4])
def test_inline_collectives_are_correct(n):
    res = run(every_collective, n, report=False)
    for r, out in enumerate(res):
        t = lambda q: (torch.arange(6 * n, dtype=torch.float64) + 100 * q).reshape(2 * n, 3)  # noqa: E731
        assert torch.equal(out["all_gather0"], torch.cat([t(q) for q in range(n)]))
        assert torch.equal(out["all_gather1"], torch.cat([t(q) for q in range(n)], dim=1))
        assert torch.equal(
            out["all_gather_v"], torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
        )
        total = sum(t(q) for q in range(n))
        assert torch.equal(out["reduce_scatter0"], total.chunk(n)[r])
        assert torch.equal(out["reduce_scatter1"], total.T.chunk(n, dim=1)[r])
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(
            out["all_to_all"], torch.cat([t(q).chunk(n)[r] for q in range(n)], dim=1)
        )
        assert torch.equal(out["ring"], t((r - 1) % n) + 0.5)
        if r == n - 1:
            assert torch.equal(out["recv"], t(0)[:1])


def test_trace_bytes_follow_the_table():
    res = run(every_collective, 4, report=False)
    tr: Trace = res.traces[1]
    b = 8 * 3 * 4 * 2  # one [2n, 3] float64 tensor, n = 4
    ag = [r for r in tr if r.op == "all_gather" and r.shape == (8, 3)]
    assert ag[0] == CommRecord("all_gather", "world", 4, 3 * b, 3 * b, (8, 3), "float64")
    rs = [r for r in tr if r.op == "reduce_scatter"][0]
    assert (rs.bytes_sent, rs.bytes_recv) == (3 * b // 4, 3 * b // 4)
    ar = [r for r in tr if r.op == "all_reduce"][0]
    assert ar.bytes_sent == 2 * 3 * b // 4
    a2a = [r for r in tr if r.op == "all_to_all"][0]
    assert a2a.bytes_sent == 3 * b // 4
    assert tr.count("barrier") == 1 and tr.bytes_sent(op="barrier") == 0
    assert tr.summary()[("sendrecv", "world")] == (1, b, b)


@pytest.mark.torchrun
def test_torchrun_matches_inline_data_and_traces():
    inline = run(every_collective, 3, report=False)
    real = run(every_collective, 3, backend="torchrun", dist_backend="gloo", report=False)
    assert real.dist_backend == "gloo"
    for a, b in zip(inline, real):
        _assert_same(a, b)
    assert [list(t) for t in inline.traces] == [list(t) for t in real.traces]
    assert inline.stdout == real.stdout


@pytest.mark.torchrun
def test_reordered_groups_and_the_legacy_paths_match_inline():
    """A group whose order is not its ranks' order, and a 0-dim all-gather, on gloo by the
    default paths and by those an older torch (sorted groups, reordered by cpbook) and NCCL
    (the single-tensor all-gather) take."""
    inline = run(reordered_collectives, 3, report=False)
    for legacy in (False, True):
        real = run(
            reordered_collectives,
            3,
            "torchrun",
            {"legacy": legacy},
            dist_backend="gloo",
            report=False,
        )
        assert [r["order"] for r in real] == [[2, 1, 0] if legacy else None] * 3
        for a, b in zip(inline, real):
            for key in a.keys() - {"order"}:
                got, want = b[key], a[key]
                same = (
                    all(torch.equal(x, y) for x, y in zip(got, want))
                    if isinstance(want, list)
                    else torch.equal(got, want)
                )
                assert same, (legacy, key)
        assert [list(t) for t in inline.traces] == [list(t) for t in real.traces]


def test_inline_timeout_raises_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"(?s)rank 0 of 2 failed.*CommTimeout.*timed out after 1 s"
    ):
        run(skip_collective, 2, timeout=1.0, report=False)
    assert time.monotonic() - t0 < 10


@pytest.mark.torchrun
def test_torchrun_timeout_raises_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"(?s)rank 0 of 2 failed.*CommTimeout.*timeout 3 s\) at global rank 0"
    ):
        run(skip_collective, 2, backend="torchrun", timeout=3.0, dist_backend="gloo", report=False)
    assert time.monotonic() - t0 < 60
    assert process_group_timeout_s(3.0) >= 2 * 3.0  # the process group gives up later


def test_shape_rules_are_value_errors():
    def bad(ctx):
        return ctx.world.reduce_scatter(torch.ones(3), dim=0)

    with pytest.raises(RuntimeError, match=r"reduce_scatter-divisible"):
        run(bad, 2, report=False)


def overlapped_exchanges(ctx) -> dict:
    """Two ``sendrecv_async`` in flight at once (different peers and shapes), then a blocking
    ``sendrecv`` with the same arguments as the first, for its trace."""
    r, n, g = ctx.rank, ctx.world_size, ctx.world
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r
    back = torch.full((r + 1, 2), float(r))  # rank r receives rank r+1's (r+2, 2) tensor
    fwd = g.sendrecv_async(t, (r + 1) % n, (r - 1) % n)
    bwd = g.sendrecv_async(back, (r - 1) % n, (r + 1) % n, like=torch.empty((r + 1) % n + 1, 2))
    out = {"bwd": bwd.wait(), "fwd": fwd.wait()}
    first = len(ctx.trace)
    g.sendrecv(t, (r + 1) % n, (r - 1) % n)
    out["records"] = (ctx.trace[0], ctx.trace[first])
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_sendrecv_async_overlaps_and_traces_like_sendrecv(n):
    for r, out in enumerate(run(overlapped_exchanges, n, report=False)):
        assert torch.equal(out["fwd"], torch.arange(6.0).reshape(2, 3) + 10 * ((r - 1) % n))
        assert torch.equal(out["bwd"], torch.full(((r + 1) % n + 1, 2), float((r + 1) % n)))
        a, b = out["records"]
        assert a == b and (a.op, a.bytes_sent, a.bytes_recv) == ("sendrecv", 48, 48)


@pytest.mark.torchrun
@pytest.mark.slow
def test_sendrecv_async_under_torchrun():
    inline = run(overlapped_exchanges, 3, report=False)
    real = run(overlapped_exchanges, 3, backend="torchrun", dist_backend="gloo", report=False)
    for a, b in zip(inline, real):
        assert torch.equal(a["fwd"], b["fwd"]) and torch.equal(a["bwd"], b["bwd"])
    assert [list(t) for t in inline.traces] == [list(t) for t in real.traces]
