"""Chapter 2's layer: vLLM's DCP slot mapping on one CPU thread, and the P/D waste table.

``python bench/kvcache.py --json`` prints one JSON object per line:
``{"name": "slot_mapping", "tokens": 1048576, "ms": ...}`` (median of ``--repeats`` runs on one
thread), then one ``{"name": "transfer_waste", ...}`` line per (sequence length, interleave).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cpbook.kv.layout import num_virtual_blocks, slot_mapping
from cpbook.kv.transfer import transfer_plan
from cpbook.timing import stopwatch


def bench_slot_mapping(
    tokens: int, block_size: int, dcp: int, interleave: int, repeats: int
) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(2 * num_virtual_blocks(tokens, block_size, dcp), generator=gen)
    positions = torch.arange(tokens)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        with stopwatch() as t:
            slots = slot_mapping(positions, table, block_size, dcp, 1, interleave)
        times.append(t.ms)
    assert int((slots >= 0).sum()) == tokens // dcp
    return {
        "name": "slot_mapping",
        "tokens": tokens,
        "ms": round(statistics.median(times[1:]), 2),
        "threads": torch.get_num_threads(),
        "device": "cpu",  # host bookkeeping in cpbook; vLLM v0.34 runs it as a GPU kernel
        # (_compute_slot_mappings_kernel, vllm/v1/worker/gpu/block_table.py)
        "block_size": block_size,
        "dcp": dcp,
        "interleave": interleave,
        "repeats": repeats,
    }


def waste_table(
    lengths: list[int], block_size: int, dcp: int, interleaves: list[int]
) -> list[dict]:
    return [
        {"name": "transfer_waste"} | transfer_plan(n, block_size, dcp, i).as_dict()
        for n in lengths
        for i in interleaves
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dcp-size", type=int, default=4)
    p.add_argument("--interleave", type=int, default=1)
    a = p.parse_args()
    rows = [bench_slot_mapping(a.tokens, a.block_size, a.dcp_size, a.interleave, a.repeats)]
    rows += waste_table(
        [16, 100, 1000, 5000, 33000, 131000], a.block_size, a.dcp_size, [1, 4, a.block_size]
    )
    for row in rows:
        if a.json:
            print(json.dumps(row))
        else:
            print("  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
