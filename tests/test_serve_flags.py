"""Tests for cpbook.planner.serve_flags: the ``vllm serve`` line vLLM v0.34.0 starts (multi-node
flags, the long-context variable, the interleave flag only when set) and its parser."""

from __future__ import annotations

import shlex

from cpbook import costmodel as cm
from cpbook import planner as pl
from cpbook.costmodel import Deployment
from cpbook.planner import ServingWorkload, plan
from cpbook.planner.serve_flags import (
    Launch,
    max_model_len_note,
    node_commands,
    serve_args,
    serve_command,
)

K = 1024
L405 = cm.MODELS["Llama-3.1-405B"]
MEM = dict(max_num_seqs=1, gpu_memory_utilization=0.9)


def test_multi_node_lines_carry_vllm_flags():
    tp16 = Deployment(tp=16)
    lines = node_commands(L405, tp16, "bf16", max_model_len=4 * K, **MEM, launch=Launch(8))
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        argv = shlex.split(line)
        i = argv.index("--nnodes")
        assert argv[i : i + 6] == ["--nnodes", "2", "--node-rank", str(rank)] + [
            "--master-addr",
            "HEAD_NODE_IP",
        ]
        assert ("--headless" in argv) == (rank > 0)
        assert pl.parse_serve_command(line) == (Deployment(tp=16), "bf16")
    tp8 = Deployment(tp=8)
    one = serve_command(L405, tp8, "bf16", max_model_len=4 * K, **MEM, launch=Launch(8))
    assert "--nnodes" not in one
    assert len(node_commands(L405, tp8, "bf16", max_model_len=4 * K, **MEM)) == 1


def test_uneven_world_gets_the_nnodes_vllm_accepts():
    d = Deployment(tp=4, dp=3)
    args = serve_args(L405, d, "bf16", max_model_len=4 * K, **MEM, launch=Launch(8))
    assert args[args.index("--nnodes") + 1] == "2"  # 12 ranks, 6 per node


def test_plan_prints_multi_node_flags_on_16_gpus():
    w = ServingWorkload(120 * K, 1 * K, 1)
    p = plan(L405, "H200", 16, w, objective="ttft", advise=False)
    assert "--nnodes" not in p.command()  # TP8 wins on 8-GPU nodes
    wide = next(e for e in p.ranked if e.deployment == Deployment(tp=16))
    assert "--nnodes 2 --node-rank 0 --master-addr HEAD_NODE_IP" in p.command(wide)


def test_interleave_only_when_set():
    d = Deployment(tp=8, dcp=8)
    model = cm.MODELS["DeepSeek-V3"]
    plain = serve_args(model, d, "bf16", max_model_len=4 * K, **MEM)
    assert "--cp-kv-cache-interleave-size" not in plain
    pd = serve_args(model, d, "bf16", max_model_len=4 * K, **MEM, cp_kv_cache_interleave_size=64)
    assert pd[pd.index("--cp-kv-cache-interleave-size") + 1] == "64"


def test_long_context_line_names_what_vllm_needs():
    line = serve_command(L405, Deployment(tp=8), "bf16", max_model_len=1049600, **MEM)
    assert line.startswith("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve ")
    assert pl.parse_serve_command(line) == (Deployment(tp=8), "bf16")
    note = max_model_len_note(L405, 1049600)
    assert "131,072" in note and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in note
    exact = serve_command(L405, Deployment(tp=8), "bf16", max_model_len=131072, **MEM)
    assert exact.startswith("vllm serve ") and max_model_len_note(L405, 131072) is None


def test_cli_gpus_per_node(capsys):
    from cpbook.cli import main

    base = ["plan", "--model", "Llama-3.1-405B", "--gpus", "16", "--context", "120K"]
    base += ["--objective", "ttft"]
    assert main(base) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[3:5] == ["--tensor-parallel-size", "8"]
    assert main([*base, "--gpus-per-node", "16"]) == 0  # one 16-GPU NVLink domain
    first = capsys.readouterr().out.splitlines()[0]
    assert "--tensor-parallel-size 16" in first and "--nnodes" not in first
