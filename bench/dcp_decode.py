"""DCP decode: KV bytes, attention time and traffic per rank as the DCP size grows.

``python bench/dcp_decode.py --json`` prints one JSON object per DCP size (1, 2, 4) for one
decode step of one request with a 64K-token context, 8 query heads, 1 KV head, head_dim 64,
float32, TP = DCP (``tp // num_kv_heads`` ranks share the KV head)::

    {"name": "dcp_decode", "dcp": N, "kv_bytes_per_rank": ..., "attn_ms_per_rank": ...,
     "bytes_per_step": ..., "max_abs_err": ...}

* ``kv_bytes_per_rank``: bytes of K and V the fullest rank stores (from its paged cache).
  Target: ``total / N`` within one block.
* ``attn_ms_per_rank``: the slowest rank's local attention (all 8 gathered heads over its
  shard), median CPU time of one thread (``time.thread_time``).  Target: at most
  ``1.15 × (single-rank time / N)``; ``ratio_vs_ideal`` is that quotient.
* ``bytes_per_step``: bytes one rank sends in the step (AllGather Q, AllGather LSE,
  ReduceScatter), from the trace.  ``max_abs_err``: against float64 dense attention.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cpbook.core.comm import comm_bytes
from cpbook.core.config import ParallelConfig
from cpbook.core.launch import run
from cpbook.core.problems import gqa_decode_problem
from cpbook.dcp.decode import local_attention
from cpbook.demos.ch03_decode import gqa_decode_rank
from cpbook.kv.paged import shard_kv_cache
from cpbook.timing import stopwatch

CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 65536, 8, 1, 64, 16


def local_attention_ms(sizes: tuple[int, ...], repeats: int) -> dict[int, list[float]]:
    """Per DCP size, each rank's median thread CPU time (ms) of its local attention, one thread.

    Every repeat times every (size, rank) shard once, round-robin, so that load from other
    processes falls on all sizes alike.
    """
    q, ks, vs = gqa_decode_problem(
        HEADS, KV_HEADS, HEAD_DIM, [CONTEXT], seed=0, dtype=torch.float32
    )
    shards = {
        (n, r): shard_kv_cache(ks, vs, BLOCK, n, r, 1)[0][0][:2] for n in sizes for r in range(n)
    }
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in shards}
    for i in range(repeats + 1):
        for key, (k, v) in shards.items():
            with stopwatch(clock="thread") as t:
                local_attention(q, [k], [v])
            if i:  # the first round warms up
                samples[key].append(t.seconds)
    return {n: [1e3 * statistics.median(samples[(n, r)]) for r in range(n)] for n in sizes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the only output format)")
    p.add_argument("--repeats", type=int, default=31)
    a = p.parse_args()
    torch.set_num_threads(1)
    total = CONTEXT * KV_HEADS * HEAD_DIM * 4 * 2
    sizes = (1, 2, 4)
    times = local_attention_ms(sizes, a.repeats)
    single = max(times[1])
    for dcp in sizes:
        res = run(
            gqa_decode_rank,
            dcp,
            fn_kwargs=dict(
                parallel_config=ParallelConfig(
                    tensor_parallel_size=dcp,
                    decode_context_parallel_size=dcp,
                    num_q_heads=HEADS,
                    num_kv_heads=KV_HEADS,
                    head_dim=HEAD_DIM,
                    block_size=BLOCK,
                ),
                seq_lens=(CONTEXT,),
                dtype="float32",
            ),
            report=False,
        )
        ms = max(times[dcp])
        kv = max(r["kv_bytes"] for r in res)
        block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 4 * 2
        row = {
            "name": "dcp_decode",
            "dcp": dcp,
            "context": CONTEXT,
            "num_q_heads": HEADS,
            "num_kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "device": "cpu",  # thread CPU time of simulated ranks: a CPU measurement only
            "kv_bytes_per_rank": kv,
            "kv_bytes_total": total,
            "kv_within_one_block": abs(kv - total / dcp) <= block_bytes,
            "attn_ms_per_rank": round(ms, 3),
            "ratio_vs_ideal": round(ms / (single / dcp), 3),
            "bytes_per_step": max(comm_bytes(r["comm"]) for r in res),
            "max_abs_err": max(r["max_abs_err"] for r in res),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
