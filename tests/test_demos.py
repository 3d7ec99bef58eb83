"""The command line and the demo registry: every chapter's per-rank function, one-line errors."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest

from cpbook.__main__ import main
from cpbook.demos import DEMOS, demo_kwargs, demo_params, get_demo, parse_params
from cpbook.demos.ch09_engine import vllm_runs_layout
from cpbook.engine.config import RunnerConfig


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpbook", *args], capture_output=True, text=True, env=env
    )


def test_every_demo_is_a_keyword_only_rank_function():
    for name in DEMOS:
        fn = get_demo(name)
        assert fn.__name__.endswith("_rank"), name
        params = demo_params(fn)
        if "runner_config" in params:  # the engine: seed and dtype are its RunnerConfig's
            params = {f.name: (f.type, f.default) for f in dataclasses.fields(RunnerConfig)}
        assert {"seed", "dtype"} <= set(params), name
        assert params["seed"][1] == 0 and params["dtype"][1] == "float64", name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "nosuch"], "[demo-name] requires one of"),
        (["demo", "pcp", "--param", "seq_lens=abc"], "[param-seq_lens] requires a Sequence[int]"),
        (["demo", "pcp", "--param", "bogus=1"], "[param-name] requires one of"),
        (["demo", "pcp", "--param", "head_dim"], "[param-syntax] requires KEY=VALUE"),
        (["demo", "pcp", "--param", "head_dim=-4"], "[param-head_dim] requires a value >= 0"),
        (["demo", "merge", "--param", "num_keys=2.5"], "[param-num_keys] requires a int"),
        (
            ["demo", "dcp-gqa", "--world-size", "6", "--param", "decode_context_parallel_size=4"],
            "[tp-divisible-by-dcp] requires tensor_parallel_size % decode_context_parallel_size",
        ),
    ],
)
def test_errors_are_one_line_with_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cpbook: error: {message}") and err.count("\n") == 1
    assert "Traceback" not in err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="demo-name"):
        main(["demo", "nosuch", "--debug"])


def test_params_are_parsed_against_the_signature():
    fn = get_demo("pcp")
    kw = parse_params(fn, ["seq_lens=8,3", "tensor_parallel_size=2", "partition=striped"])
    default = inspect.signature(fn).parameters["parallel_config"].default
    config = dataclasses.replace(default, tensor_parallel_size=2)  # the config's fields, flat
    assert demo_params(fn)["tensor_parallel_size"] == (int, 1)
    assert kw == {"seq_lens": (8, 3), "parallel_config": config, "partition": "striped"}
    assert parse_params(get_demo("merge"), ["seed=-1"]) == {"seed": -1}


def test_demo_help_lists_the_parameters(capsys):
    assert main(["demo", "pcp", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pcp (chapter 4, cpbook.demos.ch04_pcp:pcp_prefill_rank)")
    assert "seq_lens" in out and "tensor_parallel_size" in out


def test_list_names_every_chapter(capsys):
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == sorted(DEMOS, key=lambda n: (DEMOS[n][0], n))
    assert {int(line.split()[0][2:]) for line in out} >= {1, 2, 3, 4}


def test_cli_inline():
    out = _cli("demo", "merge", "--world-size", "3", "--param", "num_keys=2")
    assert out.returncode == 0, out.stderr
    assert "[rank 2] keys [0, 0): 0 of 2; merged == dense: True" in out.stdout


@pytest.mark.torchrun
def test_cli_under_torchrun():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "cpbook",
            "demo",
            "merge",
            "--dist-backend",
            "gloo",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout
    assert out.startswith("torchrun: 2 ranks, gloo\n[rank 0] keys [0, 32)")


@pytest.mark.torchrun
def test_cli_torchrun_backend_reports_a_rejected_config_in_one_line():
    out = _cli(
        "demo", "kvcache", "--world-size", "2", "--backend", "torchrun", "--param", "block_size=6"
    )
    assert out.returncode == 2
    assert out.stderr.startswith("cpbook: error: [block-size-divisible-by-interleave] requires")


def test_vllm_runs_layout_follows_pcp_managers_model_rules():
    """vLLM v0.34's PCPManager.validate_config: PCP > 1 needs MLA; with DCP > 1, sparse MLA
    (which no engine model is); PCP = 1 layouts are all vLLM's."""
    assert vllm_runs_layout("tiny-gqa", 2, 1) and vllm_runs_layout("tiny-mla", 4, 1)
    assert not vllm_runs_layout("tiny-gqa", 1, 2)  # GQA under PCP
    assert vllm_runs_layout("tiny-mla", 1, 2)  # dense MLA, PCP alone
    assert not vllm_runs_layout("tiny-mla", 2, 2)  # dense MLA, PCP x DCP


def test_flat_parameters_build_the_config_objects():
    """The CLI's flat vLLM names land in the rank function's config objects; a field two
    configs share (``dcp_comm_backend``) sets both; an invalid config fails as it is built."""
    fn = get_demo("chunked")
    kw = demo_kwargs(fn, {"dcp_comm_backend": "ag_rs", "strategy": "allgather_q", "seed": 3})
    assert kw["parallel_config"].dcp_comm_backend == kw["prefill_config"].dcp_comm_backend
    assert kw["prefill_config"].strategy == "allgather_q" and kw["seed"] == 3
    assert demo_kwargs(fn, {}) == {}
    with pytest.raises(ValueError, match=r"^\[pcp-dcp-combination\]"):
        demo_kwargs(fn, {"prefill_context_parallel_size": 3})


@pytest.mark.torchrun
def test_cli_torchrun_names_the_failing_rank_and_its_cause(tmp_path):
    """``demo merge --world-size 4 --backend torchrun`` with rank 2's ``merge_rank`` raising
    (injected at interpreter start by a ``sitecustomize`` on the workers' path): exit 2 and one
    line naming rank 2, the exception's type and its message; no traceback without --debug."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '2':\n"
        "    import cpbook.demos.ch01_merge as m\n"
        "    def merge_rank(ctx, **kw):\n"
        "        raise ValueError('injected on rank 2')\n"
        "    m.merge_rank = merge_rank\n"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = _cli(
        "demo", "merge", "--world-size", "4", "--backend", "torchrun", "--dist-backend", "gloo",
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        "cpbook: error: RuntimeError: rank 2 of 4 failed in merge_rank under torchrun: "
        "ValueError: injected on rank 2\n"
    )
