"""Which of the vLLM functions the book reproduces changed between two releases.

``python bench/vllm_release_check.py --json [--base 0.34.0] --new X`` downloads both wheels
(``vllm_wheel.source_dir``: download only, never installed), extracts each function the book
reproduces by its qualified name in a named file with :mod:`ast` (or, for code inline in a
longer function, the statements between two markers), and prints one JSON object per line:

* ``{"name": "function", "file", "qualname", "status", "base_sha", "new_sha"}`` with ``status``
  ``unchanged`` (same source text), ``reformatted`` (same syntax tree: only comments, docstring
  layout or formatting differ), ``changed``, ``missing`` (in the base, not in the new release)
  or ``new`` (only in the new release);
* ``{"name": "check", "function", "release", "agrees", "cases", "first_difference"}`` where the
  function is pure Python (with torch/numpy): vLLM's own code, extracted and run on the cases
  cpbook's tests pin (the groups, local lengths, the LSE combine, the DCP size rule, the PCP
  partition), compared with cpbook's implementation;
* a ``{"name": "summary", ...}`` line with the counts.

A bench, not a test: it needs the package registry (or the wheels in ``$CPBOOK_VLLM_CACHE``).
"""

from __future__ import annotations
import __future__

import argparse
import ast
import functools
import hashlib
import itertools
import json
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_wheel import ANCHOR_RELEASE, source_dir  # noqa: E402

from cpbook.core.attention import merge_attn_states  # noqa: E402
from cpbook.core.config import ParallelConfig  # noqa: E402
from cpbook.core.groups import GROUP_ORDERS, RankGrid  # noqa: E402
from cpbook.kv.layout import local_seq_len  # noqa: E402
from cpbook.pcp.zigzag import pcp_partition  # noqa: E402

OPS = "vllm/v1/attention/ops/"
PCP = "vllm/v1/worker/gpu/pcp_manager.py"
MLA = "vllm/model_executor/layers/attention/mla_attention.py"


@dataclass(frozen=True)
class Target:
    """A function (``qualname`` in ``file``), or the statements of it from the one containing
    ``start`` up to (not including) the one containing ``end``."""

    file: str
    qualname: str
    start: str | None = None
    end: str | None = None

    @property
    def key(self) -> str:
        return self.qualname + (f"[{self.start}]" if self.start else "")


DCP_GROUPS = Target(
    "vllm/distributed/parallel_state.py",
    "initialize_model_parallel",
    "dcp_size = decode_context_model_parallel_size",
    "_DCP = init_model_parallel_group",
)
DCP_SIZE_RULE = Target(
    "vllm/config/parallel.py",
    "ParallelConfig._validate_parallel_config",
    "tp = self.tensor_parallel_size",
    "return self",
)
LOCAL_SEQ_LENS = Target("vllm/v1/attention/backends/utils.py", "get_dcp_local_seq_lens")
LSE_COMBINE = Target(OPS + "dcp.py", "_lse_weighted_combine")
RANK_CHUNKS = Target(PCP, "PCPManager._iter_rank_chunks")
REPLICATED = Target(PCP, "PCPManager.replicated_requests")

TARGETS = [
    DCP_GROUPS,
    LOCAL_SEQ_LENS,
    Target("vllm/v1/worker/gpu/block_table.py", "_compute_slot_mappings_kernel"),
    Target("vllm/v1/worker/gpu/block_table.py", "BlockTables.compute_slot_mappings"),
    Target("vllm/v1/worker/gpu/block_table.py", "BlockTables.append_block_ids"),
    Target("vllm/v1/worker/block_table.py", "BlockTable.compute_slot_mapping"),
    LSE_COMBINE,
    *(
        Target(OPS + "dcp.py", q)
        for q in (
            "correct_attn_out",
            "_cp_lse_common",
            "cp_lse_ag_out_rs",
            "cp_lse_ag_out_ar",
            "dcp_a2a_lse_reduce",
            "dcp_a2a_v_up_proj_lse_reduce",
            "MLADCPManager._gather_query",
        )
    ),
    RANK_CHUNKS,
    REPLICATED,
    *(Target(PCP, f"PCPManager.{q}") for q in ("partition_batch", "_build_batch_layout")),
    Target(PCP, "PCPManager.validate_config"),
    Target(PCP, "PCPManager.restore_hidden_states"),
    Target(OPS + "pcp.py", "_gather_prefill_cache_inputs"),
    Target(MLA, "reorg_kvcache"),
    Target(MLA, "MLACommonBaseImpl._context_parallel_compute_prefill_context"),
    Target("vllm/v1/attention/backends/flash_attn.py", "FlashAttentionImpl._forward_with_dcp"),
    DCP_SIZE_RULE,
    Target("vllm/config/parallel.py", "ParallelConfig.pcp_shard_decode_requests"),
    Target("vllm/config/parallel.py", "ParallelConfig.set_dcp_defaults"),
    Target("vllm/config/model.py", "ModelConfig.verify_with_parallel_config"),
    Target("vllm/config/vllm.py", "VllmConfig.validate_block_size"),
    Target("vllm/config/vllm.py", "VllmConfig.adjust_dcp_kv_cache_interleave_size"),
    Target("vllm/config/cache.py", "CacheConfig.resolved_gpu_memory_utilization"),
    Target("vllm/v1/worker/cp_utils.py", "check_attention_cp_compatibility"),
    Target("vllm/v1/worker/cp_utils.py", "should_skip_dcp_context_attention"),
    Target("vllm/v1/core/kv_cache_utils.py", "resolve_dcp_kv_block_size"),
]


# ------------------------------------------------------------------------------- extraction
def find_node(tree: ast.AST, qualname: str) -> ast.AST | None:
    """The function or class ``qualname`` (dotted through classes) defined in ``tree``."""
    node: ast.AST | None = tree
    for part in qualname.split("."):
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
    return node


def extract(source: str, target: Target) -> tuple[str, ast.AST] | None:
    """``(source text, syntax tree)`` of ``target`` in the module text ``source``, or ``None``.

    A function's text starts at its first decorator; a segment is the statements from the first
    whose text contains ``start`` up to the first later one containing ``end``."""
    node = find_node(ast.parse(source), target.qualname)
    if node is None:
        return None
    if target.start is None:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        lines = source.splitlines()[first - 1 : node.end_lineno]
        text = textwrap.dedent("\n".join(lines))
        return text, ast.parse(text).body[0]
    stmts = [(s, ast.get_source_segment(source, s) or "") for s in node.body]
    begin = next((i for i, (_, t) in enumerate(stmts) if target.start in t), None)
    if begin is None:
        return None
    stop = next((i for i, (_, t) in enumerate(stmts) if i > begin and target.end in t), None)
    if stop is None:
        return None
    lines = source.splitlines()[stmts[begin][0].lineno - 1 : stmts[stop - 1][0].end_lineno]
    text = textwrap.dedent("\n".join(lines))
    return text, ast.parse(text)


def _tree_digest(node: ast.AST) -> str:
    """A hash of the syntax tree without docstrings (comments are not in it)."""
    node = ast.parse(ast.unparse(node))
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(getattr(body[0], "value", None), ast.Constant):
                if isinstance(body[0].value.value, str):
                    body[0] = ast.Pass()
    return hashlib.sha256(ast.dump(node).encode()).hexdigest()[:12]


def compare(base: Path, new: Path, target: Target) -> dict:
    """One ``function`` line: ``target``'s status between the two releases' sources."""
    found = {}
    for label, root in (("base", base), ("new", new)):
        path = root / target.file
        found[label] = extract(path.read_text(), target) if path.exists() else None
    row = {"name": "function", "file": target.file, "qualname": target.key}
    b, n = found["base"], found["new"]
    row["base_sha"] = hashlib.sha256(b[0].encode()).hexdigest()[:12] if b else None
    row["new_sha"] = hashlib.sha256(n[0].encode()).hexdigest()[:12] if n else None
    if b is None and n is None:
        row["status"] = "absent"
    elif n is None:
        row["status"] = "missing"
    elif b is None:
        row["status"] = "new"
    elif b[0] == n[0]:
        row["status"] = "unchanged"
    elif _tree_digest(b[1]) == _tree_digest(n[1]):
        row["status"] = "reformatted"
    else:
        row["status"] = "changed"
    return row


@functools.cache
def _code(root: Path, target: Target) -> types.CodeType:
    text, _ = extract((root / target.file).read_text(), target)
    flags = __future__.annotations.compiler_flag
    return compile(text, f"{target.file}:{target.key}", "exec", flags=flags)


def load(root: Path, target: Target, namespace: dict) -> dict:
    """Execute ``target``'s extracted text in ``namespace`` (annotations are not evaluated)."""
    exec(_code(root, target), namespace)
    return namespace


# ------------------------------------------------------------------------------------ checks
def _result(cases: list, differ: list) -> dict:
    return {"agrees": not differ, "cases": len(cases), "first_difference": differ[:1] or None}


def check_groups(root: Path) -> dict:
    """vLLM's DCP group statements on every (tp, pcp, dcp) in {1, 2, 4, 8, 16}^3 that forms a
    grid, against cpbook's :class:`RankGrid` in each order; ``matches``: the orders it equals."""
    cases = [t for t in itertools.product((1, 2, 4, 8, 16), repeat=3) if (t[0] * t[1]) % t[2] == 0]
    got = {}
    for tp, pcp, dcp in cases:
        ns = {
            "torch": torch,
            "all_ranks": torch.arange(tp * pcp).reshape(-1, 1, 1, pcp, tp),
            "decode_context_model_parallel_size": dcp,
            "enable_elastic_ep": False,
            "local_all_ranks": None,
        }
        groups = load(root, DCP_GROUPS, ns)["group_ranks"]
        got[(tp, pcp, dcp)] = [g.tolist() if torch.is_tensor(g) else list(g) for g in groups]
    matches = [
        o
        for o in GROUP_ORDERS[1:]
        if all(RankGrid(*t, o).dcp_groups() == g for t, g in got.items())
    ]
    differ = [t for t, g in got.items() if RankGrid(*t).dcp_groups() != g]
    return _result(cases, differ) | {"against": "RankGrid (anchor order)", "matches": matches}


def check_local_seq_lens(root: Path) -> dict:
    """``get_dcp_local_seq_lens`` against :func:`local_seq_len` on 0..130 tokens, DCP 1..8,
    interleave 1, 2, 4, 16, every rank."""
    fn = load(root, LOCAL_SEQ_LENS, {"torch": torch})["get_dcp_local_seq_lens"]
    cases = list(itertools.product(range(131), range(1, 9), (1, 2, 4, 16)))
    differ = []
    for n, dcp, i in cases:
        got = fn(torch.tensor([n]), dcp, None, i)[0].tolist()
        want = [local_seq_len(n, dcp, r, i) for r in range(dcp)]
        if got != want:
            differ.append({"seq_len": n, "dcp": dcp, "interleave": i, "vllm": got, "cpbook": want})
    return _result(cases, differ) | {"against": "cpbook.kv.layout.local_seq_len"}


def check_lse_combine(root: Path) -> dict:
    """vLLM's reference combine ``_lse_weighted_combine`` against cpbook's
    :func:`merge_attn_states` in float64 (≤ 1e-12), with empty shards (LSE ``-inf``)."""
    fn = load(root, LSE_COMBINE, {"torch": torch})["_lse_weighted_combine"]
    gen = torch.Generator().manual_seed(0)
    cases, differ = list(itertools.product((1, 2, 3, 4, 8), range(4))), []
    for n, seed in cases:
        outs = torch.randn(n, 5, 3, 4, generator=gen, dtype=torch.float64)
        lses = torch.randn(n, 5, 3, generator=gen, dtype=torch.float64) * 3
        lses[torch.rand(n, 5, 3, generator=gen) < 0.2 * seed] = float("-inf")
        out, lse = fn(outs, lses, return_lse=True)
        want, want_lse = merge_attn_states(list(outs), list(lses))
        fine = torch.isfinite(want_lse)
        err = (out - want).abs().max().item()
        if err > 1e-12 or not torch.allclose(lse[fine], want_lse[fine], atol=1e-12, rtol=0):
            differ.append({"ranks": n, "seed": seed, "max_abs_err": err})
    return _result(cases, differ) | {"against": "cpbook.core.attention.merge_attn_states"}


def check_dcp_size_rule(root: Path) -> dict:
    """``ParallelConfig``'s DCP size rule (PCP = 1: ``tp % dcp``; else DCP in {1, PCP, TP·PCP})
    against cpbook's ``ParallelConfig`` on an MLA model, TP, PCP, DCP in 1..8."""
    cases = list(itertools.product(range(1, 9), repeat=3))
    differ = []
    for tp, pcp, dcp in cases:
        me = types.SimpleNamespace(
            tensor_parallel_size=tp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
        )
        try:
            load(root, DCP_SIZE_RULE, {"self": me})
            vllm_ok = True
        except ValueError:
            vllm_ok = False
        try:
            ParallelConfig(
                tensor_parallel_size=tp,
                prefill_context_parallel_size=pcp,
                decode_context_parallel_size=dcp,
                num_q_heads=840,
                num_kv_heads=1,
                use_mla=True,
            )
            ours = True
        except ValueError:
            ours = False
        if vllm_ok != ours:
            differ.append({"tp": tp, "pcp": pcp, "dcp": dcp, "vllm": vllm_ok, "cpbook": ours})
    return _result(cases, differ) | {"against": "cpbook.core.config.ParallelConfig (MLA)"}


def check_pcp_partition(root: Path) -> dict:
    """``PCPManager._iter_rank_chunks`` for one prefill at DCP 1 against cpbook's zigzag
    :func:`pcp_partition`: each rank's real positions, 1..96 tokens, PCP 1..4."""
    ns = load(root, RANK_CHUNKS, {"np": np})
    ns = load(root, REPLICATED, ns)
    cls = type("PCP", (), {k: ns[k] for k in ("_iter_rank_chunks", "replicated_requests")})
    cases, differ = list(itertools.product(range(1, 97), range(1, 5))), []
    for n, pcp in cases:
        me = cls()
        me.pcp_world_size, me.dcp_world_size, me.shard_decode_requests = pcp, 1, False
        part = pcp_partition(n, pcp)
        for r in range(pcp):
            chunks = me._iter_rank_chunks(r, np.array([n]), np.array([True]))
            got = [o + j for _, o, length in chunks for j in range(length)]
            want = [p for p in part.rank_tokens[r] if p < n]
            if got != want:
                differ.append({"seq_len": n, "pcp": pcp, "rank": r, "vllm": got[:8]})
    return _result(cases, differ) | {"against": "cpbook.pcp.zigzag.pcp_partition"}


CHECKS = {
    DCP_GROUPS.key: check_groups,
    LOCAL_SEQ_LENS.key: check_local_seq_lens,
    LSE_COMBINE.key: check_lse_combine,
    DCP_SIZE_RULE.key: check_dcp_size_rule,
    RANK_CHUNKS.key: check_pcp_partition,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the default layout too)")
    p.add_argument("--base", default=ANCHOR_RELEASE, help="the release the book anchors to")
    p.add_argument("--new", required=True, help="the release to compare with it")
    a = p.parse_args(argv)
    roots = {"base": source_dir(a.base), "new": source_dir(a.new)}
    rows = [
        compare(roots["base"], roots["new"], t) | {"base": a.base, "new": a.new} for t in TARGETS
    ]
    for key, check in CHECKS.items():
        for label in ("base", "new"):
            version = a.base if label == "base" else a.new
            try:
                res = check(roots[label])
            except Exception as e:  # noqa: BLE001 - a release whose code no longer runs here
                res = {"agrees": False, "error": f"{type(e).__name__}: {e}"}
            rows.append({"name": "check", "function": key, "release": version} | res)
    status = [r["status"] for r in rows if r["name"] == "function"]
    summary = {"name": "summary", "base": a.base, "new": a.new, "functions": len(status)}
    summary["status"] = {s: status.count(s) for s in sorted(set(status))}
    summary["changed"] = [r["qualname"] for r in rows if r.get("status") in ("changed", "missing")]
    for label, version in (("base", a.base), ("new", a.new)):
        summary[f"checks_failed_{label}"] = [
            r["function"]
            for r in rows
            if r["name"] == "check" and r["release"] == version and not r["agrees"]
        ]
    for row in [*rows, summary]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
