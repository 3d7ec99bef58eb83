"""Device placement: every demo and engine grid runs on its rank's device, as CUDA and NCCL need.

The ranks are simulated on the CPU with ``ctx.device = cuda:0`` and :mod:`tests.device_sim`'s
tagged stand-in for that device.  A run fails on any op mixing device and host tensors, any
collective or send/recv given a host tensor, any collective whose per-rank shapes or dtypes
differ, any attention that ran on the host, and any host read of a device tensor (``.item()``,
``.tolist()``, ``int()`` ...) outside :data:`NEEDED_SYNCS`.  Explicit copies to the host (the
demos compare with their float64 references that way) are allowed.
"""

from __future__ import annotations

import pytest
import torch

from cpbook.core.launch import run
from cpbook.demos import demo_kwargs, get_demo
from cpbook.demos.ch09_engine import grid_runs, run_world, serve_grid_rank
from cpbook.engine.engine import serve_rank
from tests.device_sim import DEVICE, DeviceLog, simulated_devices, tagged

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The host reads of device tensors cpbook needs, by function, and why.
NEEDED_SYNCS = {
    "cpbook.core.comm:Group.all_gather_v": "the gathered sizes set each rank's padding",
    "cpbook.engine.runner:ModelRunner.execute": "the sampled tokens go to the host scheduler "
    "(one read per step, as vLLM's sampler output)",
}
REJECTED = ("mix", "collective", "collective-shape", "wrong-device", "host-kernel")

DEMO_CASES = [
    ("merge", 4, {}),
    ("merge", 4, {"num_keys": 3}),  # an empty shard
    ("kvcache", 4, {}),
    ("dcp-gqa", 6, {}),
    ("dcp-gqa", 6, {"dcp_comm_backend": "a2a", "seq_lens": (5, 1, 13), "dtype": "float32"}),
    ("dcp-mla", 4, {}),
    ("dcp-mla", 4, {"dcp_comm_backend": "a2a"}),
    ("dcp-mla-ctx", 4, {}),
    ("pcp", 4, {}),
    ("pcp", 4, {"tensor_parallel_size": 2, "seq_lens": (3, 50)}),
    ("chunked", 2, {}),
    ("chunked", 4, {"strategy": "allgather_kv", "tensor_parallel_size": 2}),
    ("chunked", 2, {"use_mla": True, "head_dim": 24, "v_head_dim": 16, "strategy": "allgather_q"}),
    ("ring", 3, {}),
    ("ring", 3, {"mode": "pass_q"}),
    ("tpa", 4, {}),
    (
        "tpa",
        4,
        {"use_mla": True, "num_kv_heads": 1, "tensor_parallel_size_attention": None},
    ),  # MLA without TPA
    (
        "tpa",
        4,
        {
            "use_mla": True,
            "num_kv_heads": 1,
            "tensor_parallel_size_attention": None,
            "dcp_q_replicate": True,
        },
    ),
    ("migrate", 4, {}),
    ("migrate", 4, {"src_context_parallel_size": 4, "decode_context_parallel_size": 2}),
    ("engine", 1, {"workload": {"num_requests": 3, "max_new_tokens": 3}}),
]


def rejected(log: DeviceLog) -> str:
    """What CUDA or NCCL would reject, and the host reads not in :data:`NEEDED_SYNCS`."""
    bad = [e for e in log.of("sync", "shape-sync") if e.site not in NEEDED_SYNCS]
    return (log.table(*REJECTED) + "\n" + "\n".join(f"{e}" for e in bad[:20])).strip()


def on_device(fn, world: int, **kwargs):
    """``fn`` on ``world`` simulated ranks whose device is the tagged ``cuda:0``."""
    with simulated_devices() as (log, wrap):
        res = run(wrap(fn), world, fn_kwargs=kwargs, report=False, device=DEVICE)
    return res, log


#: The demos whose result has no ``max_abs_err`` (no dense reference inside the demo), and what
#: is checked instead.  Every other demo must return the field on every rank.
NO_ERROR_FIELD = {
    "engine": "no request failed, and the tokens equal the same run's on the host",
}


@pytest.mark.parametrize(("name", "world", "params"), DEMO_CASES)
def test_demo_runs_on_the_device(name, world, params):
    fn = get_demo(name)
    res, log = on_device(fn, world, **demo_kwargs(fn, params))
    assert not rejected(log), f"{name} {params} on {world} ranks:\n{rejected(log)}"
    if name in NO_ERROR_FIELD:
        host = run(get_demo(name), world, fn_kwargs=params, report=False)
        assert all(e is None for r in res for e in r["errors"]), [r["errors"] for r in res]
        assert [r["tokens"] for r in res] == [r["tokens"] for r in host]
        return
    missing = [rank for rank, r in enumerate(res) if "max_abs_err" not in r]
    assert not missing, (
        f"{name}: ranks {missing} return no max_abs_err (or list it in NO_ERROR_FIELD)"
    )
    bound = 1e-4 if params.get("dtype") == "float32" else 1e-10
    assert all(r["max_abs_err"] <= bound for r in res), [r["max_abs_err"] for r in res]


def test_an_engine_step_reads_the_device_once():
    """World 1: the model, caches and logits live on the device; one host read per step."""
    res, log = on_device(
        serve_rank, 1, model="tiny-mla", workload={"num_requests": 4, "max_new_tokens": 4}
    )
    assert not rejected(log), rejected(log)
    assert all(tagged(x) for x in res[0]["logits"])
    reads = log.counts("sync")[("sync", "cpbook.engine.runner:ModelRunner.execute")]
    assert 0 < reads <= res[0]["steps"]


@pytest.mark.parametrize("world", [2, 4])
def test_engine_grids_run_on_the_device(world):
    runs = [
        r
        for r in grid_runs(workload={"num_requests": 3, "max_new_tokens": 3}, max_world=4)
        if run_world(r) == world
    ][:: 2 if world == 4 else 1]
    res, log = on_device(serve_grid_rank, world, runs=runs)
    assert len(res[0]) == len(runs)
    assert not rejected(log), rejected(log)
    reads = log.counts("sync")[("sync", "cpbook.engine.runner:ModelRunner.execute")]
    assert reads <= sum(r["steps"] for rank in res for r in rank)


# ------------------------------------------------------------------------------------------
# the stand-in itself flags what CUDA and NCCL reject
# ------------------------------------------------------------------------------------------
def misplaced(ctx):
    """One of each mistake: a host operand, a host collective, uneven shapes, a host read."""
    x = torch.ones(3, device=ctx.device)
    y = x + torch.ones(3)  # host operand
    ctx.world.all_gather(torch.ones(2))  # host tensor into a collective
    ctx.world.all_gather(torch.ones(ctx.rank + 1, device=ctx.device))  # shapes differ
    n = int(y.sum())  # host read
    back = x.cpu()  # an explicit copy: fine
    return n, tagged(y), tagged(back), y.device, back.device


def test_the_stand_in_flags_what_cuda_would_reject():
    res, log = on_device(misplaced, 2)
    assert res[0] == (6, True, False, DEVICE, torch.device("cpu"))
    kinds = {e.kind for e in log.events if e.site.endswith("misplaced")}
    assert {"mix", "collective", "sync", "d2h"} <= kinds
    assert log.of("collective-shape")
