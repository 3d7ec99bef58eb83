"""attention_with_lse vs plain SDPA on the same inputs, same process, one thread.

``python bench/attention_lse.py --json`` prints one JSON object per line:
``{"name": "attention_lse", "case": ..., "ms": ..., "sdpa_ms": ..., "ratio_vs_sdpa": ...}``.
Target: ratio_vs_sdpa <= 1.10 for both cases (the LSE costs nothing extra: the CPU flash kernel
computes it anyway; plain SDPA just drops it).  Times are medians of interleaved repeats;
``--device cuda:0`` times the GPU kernels (each call bracketed by ``torch.cuda.synchronize``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from cpbook.core.attention import attention_with_lse
from cpbook.timing import device_name, stopwatch

CASES = {
    # name: (q tokens, k tokens, heads, head_dim, causal)
    "prefill_causal_4096": (4096, 4096, 8, 64, True),
    "decode_1x65536": (1, 65536, 8, 64, False),
}


def bench_case(
    tq: int, tk: int, heads: int, dim: int, causal: bool, repeats: int, device: str = "cpu"
) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tq, heads, dim, generator=g).to(device)
    k = torch.randn(tk, heads, dim, generator=g).to(device)
    v = torch.randn(tk, heads, dim, generator=g).to(device)
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # the same memory, SDPA's layout
    ours, sdpa = [], []
    for i in range(repeats + 2):
        with stopwatch(device) as t_ours:  # on a GPU the kernels, not their launch, are timed
            out, _ = attention_with_lse(q, k, v, causal=causal)
        with stopwatch(device) as t_sdpa:
            ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
        if i >= 2:  # warm-up
            ours.append(t_ours.seconds)
            sdpa.append(t_sdpa.seconds)
    err = (out - ref[0].transpose(0, 1)).abs().max().item()
    ms, sdpa_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(sdpa)
    return {
        "ms": round(ms, 3),
        "sdpa_ms": round(sdpa_ms, 3),
        "ratio_vs_sdpa": round(ms / sdpa_ms, 3),
        "max_abs_err": err,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the only output format)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda:0 for a GPU")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    for case, shape in CASES.items():
        tq, tk, h, d, causal = shape
        row = {
            "name": "attention_lse",
            "case": case,
            "tq": tq,
            "tk": tk,
            "heads": h,
            "head_dim": d,
            "dtype": "float32",
            "threads": a.threads,
            "device": device_name(a.device),
            **bench_case(*shape, repeats=a.repeats, device=a.device),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
