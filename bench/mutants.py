"""Mutation score of the fast test subset: realistic one-line bugs, each applied to a copy.

Each mutant is one exact snippet of one file replaced by a plausible wrong one (an off-by-one,
a forgotten DCP factor, a floor for a ceil, a swapped comparison).  The bench copies the
repository (without ``.git``, notebooks and build outputs) to a temporary folder once, runs the
fast subset there unmutated (it must pass), then for every mutant writes the mutated file, runs
the fast subset (``-x -q -p no:randomly``, a fixed hypothesis seed, the test files of the
mutant's area first) and restores the file.  The working tree is never touched.

Prints one JSON line per mutant (``caught`` / ``survived`` / ``stale`` when its snippet is no
longer in the file, and the first failing test) and a summary line
``{"name": "mutants", "total", "caught", "score"}`` (stale mutants are not counted).

    python bench/mutants.py              # every mutant
    python bench/mutants.py --only 3 17  # some of them, by index
    python bench/mutants.py --check      # only check that every snippet is in its file

Run it niced (``nice -n 10``), with the project's environment active (pytest, hypothesis and
transformers come from ``sys.executable``): each mutant is a pytest run on one thread.  The
baseline line reports the subset's wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The fast subset: unit and property tests of the mechanisms the mutants touch; no notebooks,
#: no torchrun, nothing marked slow.
FAST_SUBSET = [
    "tests/test_kvcache.py",
    "tests/test_kvmanager.py",
    "tests/test_scheduler.py",
    "tests/test_attention.py",
    "tests/test_groups.py",
    "tests/test_config.py",
    "tests/test_dcp.py",
    "tests/test_mla.py",
    "tests/test_pcp.py",
    "tests/test_ring.py",
    "tests/test_chunked.py",
    "tests/test_chunked_fold.py",
    "tests/test_tpa.py::test_tpa_rules_name_themselves",
    "tests/test_spec_decode.py",
    "tests/test_hf.py",
    "tests/test_hf_rope.py",
    "tests/test_plan.py",
]
MARKERS = "not torchrun and not slow and not notebook"
#: within those files, leave out what starts subprocesses or repeats a case of another test
KEYWORDS = "not cli_ and not inline_grid and not piped"
DESELECT = [
    f"tests/test_hf.py::test_tokens_and_logits_equal_transformers_on_every_layout[{family}]"
    for family in ("mistral", "qwen2", "qwen3", "deepseek_v2")
] + [
    "tests/test_attention.py::test_fused_equals_dense_float64",
    "tests/test_pcp.py::test_partition_properties",
    "tests/test_kvcache.py::test_interleave_equal_block_size_leaves_at_most_one_partial_block",
    "tests/test_kvcache.py::test_write_then_read_reconstructs_exactly",
]

#: test files run first for a mutant of a module under these folders (same subset, reordered)
AREA_FIRST = {
    "cpbook/kv/": ["tests/test_kvmanager.py", "tests/test_kvcache.py", "tests/test_scheduler.py"],
    "cpbook/core/": ["tests/test_attention.py", "tests/test_groups.py", "tests/test_config.py"],
    "cpbook/dcp/": ["tests/test_dcp.py", "tests/test_mla.py"],
    "cpbook/pcp/": ["tests/test_pcp.py", "tests/test_ring.py", "tests/test_chunked.py"],
    "cpbook/engine/hf": ["tests/test_hf_rope.py", "tests/test_hf.py"],
    "cpbook/engine/": ["tests/test_scheduler.py", "tests/test_spec_decode.py"],
    "cpbook/planner/": ["tests/test_plan.py"],
}


@dataclass(frozen=True)
class Mutant:
    """``original`` (exactly once in ``file``) becomes ``replacement``.  ``first``: the test
    file to run first (default: the area's, :data:`AREA_FIRST`); the rest of the subset runs
    only if it passes."""

    file: str
    original: str
    replacement: str
    description: str
    first: tuple[str, ...] = ()


M = Mutant
MUTANTS: list[Mutant] = [
    # -- kv -----------------------------------------------------------------------------------
    M("cpbook/kv/layout.py",
      '+ torch.div(stripe, dcp, rounding_mode="floor") * interleave',
      "+ stripe * interleave",
      "slot_mapping: the stripe's offset inside the block forgets to divide by dcp",
      ("tests/test_kvcache.py",)),
    M("cpbook/kv/layout.py",
      "return base + min(max(seq_len - base * dcp - dcp_rank * interleave, 0), interleave)",
      "return base + min(max(seq_len - base * dcp - dcp_rank * interleave, 0), dcp)",
      "local_seq_len: the last partial stripe clipped to dcp instead of interleave",
      ("tests/test_kvcache.py",)),
    M("cpbook/kv/layout.py",
      "return -(-seq_len // (block_size * dcp))",
      "return seq_len // (block_size * dcp) + 1",
      "num_virtual_blocks: one block too many when the length is a whole number of blocks"),
    M("cpbook/kv/layout.py",
      ").clamp(\n        0, vb\n    )",
      ").clamp(\n        0, block_size\n    )",
      "block_fill: tokens per virtual block clipped to block_size (forgets dcp)"),
    M("cpbook/kv/manager.py",
      "keep = num_virtual_blocks(num_tokens, self.block_size, self.dcp)",
      "keep = num_virtual_blocks(num_tokens, self.block_size, 1)",
      "truncate: forgets the DCP factor and keeps too many blocks after a rollback (leak)"),
    M("cpbook/kv/manager.py",
      "full = num_tokens // self.virtual_block_size",
      "full = -(-num_tokens // self.virtual_block_size)",
      "truncate: keeps the prefix hash of a block that is no longer full"),
    M("cpbook/kv/manager.py",
      "token_ids[: max(len(token_ids) - 1, 0)]",
      "token_ids[: len(token_ids)]",
      "cached_prefix: a whole-prompt hit leaves no token to recompute"),
    M("cpbook/kv/manager.py",
      "reusable = sum(1 for b in hit if self.ref_cnt[b] == 0)",
      "reusable = 0",
      "allocate: free-but-cached hit blocks counted twice (over-commits the free ids)"),
    M("cpbook/kv/manager.py",
      "for blk in reversed(req.blocks):",
      "for blk in req.blocks:",
      "free: releases head first, so the shared prefix is evicted before the tail"),
    M("cpbook/kv/manager.py",
      "blk, _ = self.free_queue.popitem(last=False)",
      "blk, _ = self.free_queue.popitem(last=True)",
      "_take: evicts the most recently freed block instead of the least recently used"),
    M("cpbook/kv/manager.py",
      "num_virtual_blocks(req.num_tokens + num_new_tokens, self.block_size, self.dcp)",
      "num_virtual_blocks(req.num_tokens + num_new_tokens - 1, self.block_size, self.dcp)",
      "append: one token short when it opens a new block"),
    M("cpbook/kv/manager.py",
      "if self.block_hash[blk] is None and h not in self.cached:",
      "if self.block_hash[blk] is None:",
      "_register_full_blocks: a duplicate block steals the cached hash of the first"),
    M("cpbook/kv/gather.py",
      "chunk = workspace_size // max(1, num_requests) // stripe * stripe",
      "chunk = workspace_size // stripe * stripe",
      "context_chunk_len: ignores the number of requests (overflows the workspace)",
      ("tests/test_mla.py",)),
    M("cpbook/kv/gather.py",
      "cu.append(cu[-1] + sum(counts[r][i] for r in range(n)))",
      "cu.append(cu[-1] + padded[i] * n)",
      "reorg_kvcache: request offsets count the padding rows",
      ("tests/test_mla.py",)),
    # -- core ---------------------------------------------------------------------------------
    M("cpbook/core/attention.py",
      "new = torch.logaddexp(lse, part_lse)",
      "new = torch.maximum(lse, part_lse)",
      "merge_attn_states_: max instead of log-sum-exp"),
    M("cpbook/core/attention.py",
      "out.masked_fill_(torch.isneginf(lse)[..., None], 0)",
      "out.masked_fill_(torch.isnan(lse)[..., None], 0)",
      "merge_attn_states: an empty first part leaks its (NaN) output"),
    M("cpbook/core/attention.py",
      "inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)",
      "inv = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / d)",
      "rope: frequencies over the full width instead of the half",
      ("tests/test_mla.py",)),
    M("cpbook/core/attention.py",
      "return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)",
      "return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)",
      "rope: rotates by minus the angle",
      ("tests/test_mla.py",)),
    M("cpbook/core/groups.py",
      "return RankCoords(rank, rank // tp, rank % tp, dcp_group.index(rank))",
      "return RankCoords(rank, rank // tp, rank % tp, rank % len(dcp_group))",
      "coords: dcp_rank from the rank number, not the position in its DCP group",
      ("tests/test_groups.py",)),
    M("cpbook/core/config.py",
      "if dcp_in_tp > tp // kv:",
      "if dcp_in_tp > tp:",
      "ParallelConfig: DCP beyond the KV-head replication of TP accepted",
      ("tests/test_config.py",)),
    M("cpbook/core/config.py",
      "if self.dcp_q_replicate and (not self.use_mla or dcp == 1):",
      "if self.dcp_q_replicate and (not self.use_mla and dcp == 1):",
      "ParallelConfig: query replication accepted for GQA or without DCP",
      ("tests/test_tpa.py::test_tpa_rules_name_themselves",)),
    # -- dcp ----------------------------------------------------------------------------------
    M("cpbook/dcp/decode.py",
      "total = torch.log(torch.exp(lses - m).sum(dim=0)) + m",
      "total = torch.log(torch.exp(lses - m).sum(dim=0))",
      "dcp_combine: the total LSE forgets the max it subtracted"),
    M("cpbook/dcp/decode.py",
      "factor = torch.exp(lses[rank] - total)",
      "factor = torch.exp(lses[rank] - m)",
      "dcp_combine: rescales by the max LSE instead of the total"),
    M("cpbook/dcp/comm_bytes.py",
      '("reduce_scatter", b * h * out_dim * e * (n - 1)),',
      '("reduce_scatter", b * h * out_dim * e * n),',
      "GQA decode bytes: reduce-scatter counts the rank's own share"),
    M("cpbook/dcp/mla.py",
      "return 1.0 / math.sqrt(self.W_UK.shape[2] + self.qk_rope_head_dim)",
      "return 1.0 / math.sqrt(self.kv_lora_rank + self.qk_rope_head_dim)",
      "MLA softmax scale from kv_lora_rank instead of the query-key head width",
      ("tests/test_mla.py",)),
    M("cpbook/dcp/mla.py",
      "padded = counts[0]  # rank 0 holds the most rows of every chunk",
      "padded = counts[me]",
      "mla_context_attention: pads to this rank's rows, not rank 0's",
      ("tests/test_mla.py",)),
    M("cpbook/dcp/mla.py",
      "* ((kv_lora_rank + rope_dim) * elem_bytes + n * lse_bytes + kv_lora_rank * elem_bytes)",
      "* ((kv_lora_rank + rope_dim) * elem_bytes + lse_bytes + kv_lora_rank * elem_bytes)",
      "q_move_bytes: the LSE all-gather sends one LSE, not dcp",
      ("tests/test_mla.py",)),
    # -- pcp ----------------------------------------------------------------------------------
    M("cpbook/pcp/zigzag.py",
      "tail = 2 * pcp - 1 - rank",
      "tail = 2 * pcp - rank",
      "DualChunkSwap: the mirrored chunk one too far",
      ("tests/test_pcp.py",)),
    M("cpbook/pcp/zigzag.py",
      "return max(0, (end * (end + 1) - start * (start + 1)) // 2)",
      "return max(0, (end * (end - 1) - start * (start - 1)) // 2)",
      "causal_pairs: a query does not count itself",
      ("tests/test_pcp.py",)),
    M("cpbook/pcp/ring.py",
      "src = (origin - 1) % n",
      "src = (origin + 1) % n",
      "ring pass-KV: the next block's origin counted the wrong way round",
      ("tests/test_ring.py",)),
    M("cpbook/pcp/ring_plan.py",
      "return length // (i * n) * i + min(i, max(0, length % (i * n) - rank * i))",
      "return length // (i * n) * i + min(i, max(0, length % (i * n) - rank))",
      "ring plan: a rank's rows of the last stripe forget the interleave",
      ("tests/test_ring.py",)),
    M("cpbook/pcp/chunked.py",
      "(not causal or k_offset <= q_offset + q.shape[0] - 1)",
      "(not causal or k_offset <= q_offset)",
      "chunked prefill: skips key chunks that only later query rows see",
      ("tests/test_chunked_fold.py",)),
    M("cpbook/pcp/chunked_plan.py",
      "r = sum(padded_len(t, pcp) for t in query_lens) // pcp",
      "r = sum(query_lens) // pcp",
      "chunked plan: rows per rank without the DualChunkSwap padding",
      ("tests/test_chunked.py",)),
    M("cpbook/pcp/comm_bytes.py",
      '("all_gather", t * h * head_dim * elem_bytes * (k - 1)),',
      '("all_gather", t * h * head_dim * elem_bytes * k),',
      "PCP prefill bytes: the K all-gather counts the rank's own rows",
      ("tests/test_pcp.py",)),
    # -- engine -------------------------------------------------------------------------------
    M("cpbook/engine/scheduler.py",
      "self.written.update(c.block_table[: req.num_computed_tokens // vb])",
      "self.written.update(c.block_table[: -(-req.num_computed_tokens // vb)])",
      "scheduler: a partly computed block marked written (a prefix hit may read unwritten K/V)"),
    M("cpbook/engine/scheduler.py",
      "self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted",
      "self.waiting and budget > 0 and len(self.running) < self.max_num_seqs",
      "scheduler: admits new requests in a step that preempted (vLLM admits none)"),
    M("cpbook/engine/scheduler.py",
      "victim = self.running[-1]",
      "victim = self.running[0]",
      "scheduler: preempts the oldest running request instead of the newest"),
    M("cpbook/engine/scheduler.py",
      "self.waiting.appendleft(req)",
      "self.waiting.append(req)",
      "scheduler: a preempted request goes to the back of the queue"),
    M("cpbook/engine/scheduler.py",
      "if any(b not in self.written for b in self.kv.cached_prefix(tokens)):",
      "if all(b not in self.written for b in self.kv.cached_prefix(tokens)):",
      "scheduler: admits a request whose cached prefix is partly unwritten"),
    M("cpbook/engine/scheduler.py",
      'keep = len(new) if decode else c.num_tokens',
      "keep = c.num_tokens",
      "scheduler: rejected draft rows are kept (no rollback)",
      ("tests/test_spec_decode.py",)),
    M("cpbook/engine/spec_decode.py",
      "while a < len(drafts) and drafts[a] == targets[a]:",
      "while a < len(drafts) and drafts[a] == targets[a + 1]:",
      "greedy_accept: compares each draft with the next row's target",
      ("tests/test_spec_decode.py",)),
    M("cpbook/engine/spec_decode.py",
      "for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):",
      "for n in range(self.min_n, min(self.max_n, total - 1) + 1):",
      "ngram proposer: the shortest matching n-gram wins instead of the longest",
      ("tests/test_spec_decode.py",)),
    # -- the Hugging Face loader --------------------------------------------------------------
    M("cpbook/engine/hf.py",
      'if raw.get("rope_interleave", True):',
      'if raw.get("rope_interleave", False):',
      "loader: DeepSeek's interleaved rope columns not permuted by default"),
    M("cpbook/engine/hf.py",
      "scale *= m * m  # DeepSeek's YaRN softmax scale (HF yarn_apply_mscale)",
      "scale *= m",
      "loader: YaRN mscale applied once to the softmax scale instead of squared"),
    M("cpbook/engine/hf.py",
      "factor = mscale(f, ms) / mscale(f, ma) if ms and ma else mscale(f)",
      "factor = mscale(f, ma) / mscale(f, ms) if ms and ma else mscale(f)",
      "loader: YaRN attention factor inverted"),
    M("cpbook/engine/hf.py",
      "scaled = torch.where(wavelen > old / lo, inv / f, inv)",
      "scaled = torch.where(wavelen < old / lo, inv / f, inv)",
      "loader: llama3 RoPE scales the high frequencies instead of the low ones"),
    M("cpbook/engine/hf.py",
      "low, high = max(low, 0), min(high, dim - 1)",
      "low, high = max(low, 0), min(high, dim // 2 - 1)",
      "loader: YaRN ramp clipped to half the width"),
    # -- the planner --------------------------------------------------------------------------
    M("cpbook/planner/plan_space.py",
      "if not any(all(a <= b for a, b in zip(k[1:], m[1:])) for k in kept):",
      "if not any(all(a < b for a, b in zip(k[1:], m[1:])) for k in kept):",
      "pareto: keeps dominated ties"),
    M("cpbook/planner/plan.py",
      "max_num_seqs=math.ceil(w.concurrency / e.deployment.dp),",
      "max_num_seqs=w.concurrency // e.deployment.dp,",
      "plan: --max-num-seqs floored, under-provisioning a replica"),
    M("cpbook/planner/plan_space.py",
      "r = math.ceil(e.batch / e.deployment.dp)",
      "r = e.batch // e.deployment.dp",
      "gpu_seconds_per_token: the busiest replica's share floored"),
    M("cpbook/planner/plan_space.py",
      "batch = min(w.concurrency, capacity)",
      "batch = max(w.concurrency, capacity)",
      "estimate: prices a batch larger than the concurrency"),
    M("cpbook/planner/plan_space.py",
      "elif w.tpot_target_s is not None and step.total_s > w.tpot_target_s:",
      "elif w.tpot_target_s is not None and step.step_s > w.tpot_target_s:",
      "estimate: the TPOT target checked against the decode step without its prefill share"),
    M("cpbook/planner/plan_space.py",
      "decode_tokens_per_s_per_gpu=batch / step.step_s / deployment.num_gpus,",
      "decode_tokens_per_s_per_gpu=batch / step.step_s / deployment.tp,",
      "estimate: decode rate per GPU divided by TP only"),
    M("cpbook/planner/vllm_rules.py",
      "if cfg.pcp > 1 and cfg.dcp > 1 and not model.sparse_mla:",
      "if cfg.pcp > 1 and cfg.dcp > 2 and not model.sparse_mla:",
      "vllm_rules: PCP with DCP 2 accepted without sparse MLA"),
    M("cpbook/planner/serve_flags.py",
      "if cp_kv_cache_interleave_size is not None and (deployment.dcp > 1 or deployment.pcp > 1):",
      "if cp_kv_cache_interleave_size is not None and deployment.dcp > 1:",
      "serve_flags: no --cp-kv-cache-interleave-size for PCP alone"),
]  # fmt: skip


def _copy_tree(dest: Path) -> None:
    skip = {".git", "notebooks", "_build", ".hypothesis", ".pytest_cache", "results", ".venv"}
    shutil.copytree(
        ROOT, dest, ignore=lambda d, names: [n for n in names if n in skip], dirs_exist_ok=True
    )


def _order(m: Mutant) -> tuple[list[str], list[str]]:
    """The fast subset split in two: the mutant's first test files, then the others."""
    first = list(m.first) or next((t for p, t in AREA_FIRST.items() if m.file.startswith(p)), [])
    return first, [t for t in FAST_SUBSET if t not in first]


def _pytest(tree: Path, tests: list[str], timeout: int) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one core: no spinning thread pools
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "0",
        "-x",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "--hypothesis-seed=0",
        "-m",
        MARKERS,
        "-k",
        KEYWORDS,
        "-rf",
    ]
    cmd += [f"--deselect={d}" for d in DESELECT] + tests
    try:
        r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return r.returncode, r.stdout + r.stderr


def _children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _first_failure(output: str) -> str | None:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", type=int, nargs="*", help="indices of the mutants to run")
    ap.add_argument("--check", action="store_true", help="only check the snippets")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = ap.parse_args(argv)
    chosen = [(i, m) for i, m in enumerate(MUTANTS) if not args.only or i in args.only]
    if args.check:
        bad = [(i, m.file) for i, m in chosen if (ROOT / m.file).read_text().count(m.original) != 1]
        print(json.dumps({"name": "mutants-check", "total": len(chosen), "not_unique": bad}))
        return 1 if bad else 0
    with tempfile.TemporaryDirectory(prefix="cpbook-mutants-") as tmp:
        tree = Path(tmp) / "repo"
        _copy_tree(tree)
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        rc, out = (0, "") if args.no_baseline else _pytest(tree, FAST_SUBSET, args.timeout)
        base = {
            "name": "baseline",
            "rc": rc,
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(_children_cpu_s() - cpu0, 1),
        }
        print(json.dumps(base), flush=True)
        if rc != 0:
            print(out[-3000:], file=sys.stderr)
            return 2
        caught = total = 0
        for i, m in chosen:
            path = tree / m.file
            text = path.read_text()
            row = {"name": "mutant", "id": i, "file": m.file, "description": m.description}
            if text.count(m.original) != 1:
                print(json.dumps(dict(row, status="stale")), flush=True)
                continue
            path.write_text(text.replace(m.original, m.replacement))
            t0 = time.perf_counter()
            first, rest = _order(m)
            try:  # the area's files first; the rest of the subset only if they pass
                rc, out = _pytest(tree, first, args.timeout) if first else (0, "")
                if rc == 0:
                    rc, out = _pytest(tree, rest, args.timeout)
            finally:
                path.write_text(text)
            if rc in (3, 4, 5):  # pytest's internal error, usage error, no tests: not a verdict
                print(out[-3000:], file=sys.stderr)
                return 2
            total += 1
            hit = rc != 0
            caught += hit
            row.update(
                status="caught" if hit else "survived",
                by=(_first_failure(out) or ("timeout" if rc == -1 else f"rc={rc}"))
                if hit
                else None,
                wall_s=round(time.perf_counter() - t0, 1),
            )
            print(json.dumps(row), flush=True)
    score = round(100 * caught / total, 1) if total else 0.0
    print(json.dumps({"name": "mutants", "total": total, "caught": caught, "score": score}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
