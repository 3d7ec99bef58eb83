"""One request's decode attention against context: time, KV bytes read, achieved HBM fraction.

``python bench/decode_attention_gpu.py --json [--device cuda|cpu] [--store]`` prints a
machine record, then one JSON object per (shape, kernel, context)::

    {"name": "decode_attention_gpu", "kind": "gqa"|"mla", "backend": ..., "context": N,
     "kv_heads": H, "q_heads": Q, "k_width": K, "v_width": V, "dtype": ..., "elem_bytes": E,
     "time_s": ..., "kv_bytes": N * H * (K + V) * E, "bytes_per_s": ..., "peak_bytes_per_s":
     ..., "hbm_fraction": ..., "device": ..., "date_utc": ...}

Shapes (one decode query token, no batch: the one-request case chapter 8's break-even turns on):

* **GQA**: 1, 2, 4 and 8 KV heads per rank, head size 128, and the query heads of those KV
  groups (:data:`GROUP` = 8 per KV head, as Llama-3-70B's 64/8); the group's query heads are
  passed as the query rows of their KV head, the form a decode kernel runs (no copy of K/V).
* **MLA absorbed**: one latent KV head, keys/queries 576 wide (512 latent + 64 RoPE), values
  the 512-wide latent, 16 or 128 query heads (DeepSeek-V3 at TP 8, and TP 1 / DCP's
  replicated query).  SDPA takes K and V as two tensors, so it reads 576 + 512 per token;
  FlashMLA reads the one 576-wide cache (its rows say ``v_width`` 0).

Kernels: PyTorch SDPA under :func:`torch.nn.attention.sdpa_kernel` (on CUDA the flash and
memory-efficient backends, each where it takes the shape; on the CPU the math backend), and
``flash_attn`` (FlashAttention's ``flash_attn_with_kvcache``) and ``flash_mla``
(``flash_mla_with_kvcache``) where importable.  A kernel that refuses a shape prints a
``decode_attention_gpu_skip`` row saying why.

Timing: :func:`cpbook.timing.stopwatch` (CUDA-synchronised at both ends) around ``inner``
back-to-back calls, each on its own copy of the KV (together >= :data:`ROTATE_BYTES`, so the
GPU's L2 cannot serve them), divided by ``inner``; ``time_s`` is the median of ``repeats``
such samples after one warm-up.  The calls are eager launches (no CUDA graph), so the short
contexts' rows include the launch gap; the break-even reads the long-context rows
(:data:`cpbook.costmodel.break_even.LONG_CONTEXT` and up).  ``hbm_fraction`` =
``kv_bytes / time_s`` over the peak of the :data:`cpbook.costmodel.specs.GPUS` entry whose
key is in the device name (H200: 4.8 TB/s); ``null`` on the CPU or an unknown GPU.

Budget (one H200): contexts 4K ... 1M (:data:`GPU_CONTEXTS`, 9 points) x 6 shapes x at most
4 kernels, bfloat16, 10 repeats; a 1M-token GQA row with 8 KV heads reads 4 GiB (~1 ms at
4.8 TB/s), the largest allocation (K and V together).  Every (shape, kernel) stops
growing the context once a sample passes :data:`SLOW_S` (a kernel far from bandwidth-bound),
and the whole grid stops at ``--budget-s`` (default 240 s, with a ``decode_attention_gpu_stop``
row): it fits in 5 minutes with the start-up.  ``--device cpu`` is the dry run CI does: 1K,
2K and 4K tokens, float32, math backend, 2 repeats, a few seconds; it never stores.

``--store`` writes the rows (machine record first) to
``bench/results/decode_attention_gpu.jsonl``;
:func:`cpbook.costmodel.break_even.stored_kv_read` reads the long-context H200 / H100 row
back as the measured one-request KV-read efficiency of the book's break-even table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cpbook.costmodel.specs import GPUS, GPUSpec
from cpbook.timing import machine_record, stopwatch

RESULTS = Path(__file__).resolve().parent / "results" / "decode_attention_gpu.jsonl"
GPU_CONTEXTS = tuple(4096 * 2**i for i in range(9))  # 4K ... 1M
CPU_CONTEXTS = (1024, 2048, 4096)
HEAD = 128
GROUP = 8
GQA_KV_HEADS = (1, 2, 4, 8)
MLA_K, MLA_V = 576, 512
MLA_Q_HEADS = (16, 128)
#: the KV copies one timed sample rotates through: several times an H200's 50 MB L2
ROTATE_BYTES = 256 * 2**20
MAX_INNER = 64
#: a (shape, kernel) whose sample passes this stops at that context (not bandwidth-bound)
SLOW_S = 0.25


def kv_bytes(context: int, kv_heads: int, k_width: int, v_width: int, elem_bytes: int) -> int:
    """Bytes of K and V one request's decode attention reads: context x KV heads x (K + V
    width) x element size."""
    return context * kv_heads * (k_width + v_width) * elem_bytes


def gpu_spec(device_name: str) -> GPUSpec | None:
    """The :data:`~cpbook.costmodel.specs.GPUS` entry whose key is in ``device_name``
    (``"NVIDIA H200"`` -> H200), or None (the CPU, an unknown GPU)."""
    low = device_name.lower()
    hits = [spec for key, spec in GPUS.items() if key.lower() in low]
    return hits[0] if len(hits) == 1 else None


def shapes() -> Iterator[dict]:
    """The grid's shapes: GQA per KV-head count, then MLA per query-head count."""
    for h in GQA_KV_HEADS:
        yield dict(kind="gqa", kv_heads=h, q_heads=GROUP * h, k_width=HEAD, v_width=HEAD)
    for q in MLA_Q_HEADS:
        yield dict(kind="mla", kv_heads=1, q_heads=q, k_width=MLA_K, v_width=MLA_V)


def _sdpa(backend: SDPBackend) -> Callable:
    """SDPA under one backend: q (1, H, G, K) against k (1, H, L, K), v (1, H, L, V)."""

    def make(shape: dict, context: int, dtype, device) -> tuple[Callable, int]:
        h, g = shape["kv_heads"], shape["q_heads"] // shape["kv_heads"]
        q = torch.randn(1, h, g, shape["k_width"], dtype=dtype, device=device)
        k = torch.randn(1, h, context, shape["k_width"], dtype=dtype, device=device)
        v = torch.randn(1, h, context, shape["v_width"], dtype=dtype, device=device)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return call, shape["v_width"]

    return make


def _flash_attn(shape: dict, context: int, dtype, device) -> tuple[Callable, int]:
    """FlashAttention's decode entry (split-KV): q (1, 1, Q, D), k/v (1, L, H, D)."""
    from flash_attn import flash_attn_with_kvcache

    if shape["kind"] != "gqa":
        raise ValueError("flash_attn takes one head size for K and V (MLA is FlashMLA's)")
    h, d = shape["kv_heads"], shape["k_width"]
    q = torch.randn(1, 1, shape["q_heads"], d, dtype=dtype, device=device)
    k = torch.randn(1, context, h, d, dtype=dtype, device=device)
    v = torch.randn(1, context, h, d, dtype=dtype, device=device)
    seqlens = torch.tensor([context], dtype=torch.int32, device=device)
    return (lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)), d


def _flash_mla(shape: dict, context: int, dtype, device) -> tuple[Callable, int]:
    """FlashMLA: q (1, 1, Q, 576) against a paged 576-wide latent cache (64-token pages)."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    if shape["kind"] != "mla":
        raise ValueError("FlashMLA runs MLA's absorbed form only")
    page, q_heads = 64, shape["q_heads"]
    pages = -(-context // page)
    q = torch.randn(1, 1, q_heads, MLA_K, dtype=dtype, device=device)
    cache = torch.randn(pages, page, 1, MLA_K, dtype=dtype, device=device)
    table = torch.arange(pages, dtype=torch.int32, device=device).view(1, pages)
    seqlens = torch.tensor([context], dtype=torch.int32, device=device)
    meta, splits = get_mla_metadata(seqlens, q_heads, 1)

    def call():
        return flash_mla_with_kvcache(q, cache, table, seqlens, MLA_V, meta, splits, causal=False)

    return call, 0  # the values are the cache's first 512 columns: read once


def kernels(device: torch.device) -> dict[str, Callable]:
    """The kernels to time on ``device``: SDPA's backends, and FlashAttention / FlashMLA where
    importable (name -> ``make(shape, context, dtype, device) -> (call, v_width read)``)."""
    if device.type != "cuda":
        return {"sdpa_math": _sdpa(SDPBackend.MATH)}
    out = {
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    for name, make, module in (
        ("flash_attn", _flash_attn, "flash_attn"),
        ("flash_mla", _flash_mla, "flash_mla"),
    ):
        try:
            __import__(module)
        except Exception:  # absent, or built for another torch / CUDA
            continue
        out[name] = make
    return out


def measure(make: Callable, shape: dict, context: int, dtype, device, repeats: int):
    """``(median seconds per call, inner, v_width read)``: ``repeats`` samples of ``inner``
    back-to-back calls on distinct KV copies, after one warm-up sample."""
    elem = torch.empty((), dtype=dtype).element_size()
    one = kv_bytes(context, shape["kv_heads"], shape["k_width"], shape["v_width"], elem)
    inner = 1 if device.type != "cuda" else max(1, min(MAX_INNER, -(-ROTATE_BYTES // one)))
    made = [make(shape, context, dtype, device) for _ in range(inner)]
    calls, v_read = [c for c, _ in made], made[0][1]
    samples = []
    for i in range(repeats + 1):
        with stopwatch(device if device.type == "cuda" else None) as t:
            for call in calls:
                call()
        if i:
            samples.append(t.seconds / inner)
    return statistics.median(samples), inner, v_read


def rows(device: torch.device, contexts, repeats: int, budget_s: float) -> Iterator[dict]:
    """Every (shape, kernel, context) row, then a stop row if the budget ran out."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elem = torch.empty((), dtype=dtype).element_size()
    record = machine_record(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = gpu_spec(name) if device.type == "cuda" else None
    peak = spec.hbm_bw_bytes_per_s if spec else None
    base = {"device": record["device"], "date_utc": record["date_utc"]}
    spent = 0.0
    for shape in shapes():
        for backend, make in kernels(device).items():
            for context in contexts:
                if spent > budget_s:
                    yield {"name": "decode_attention_gpu_stop", "budget_s": budget_s, **base}
                    return
                where = dict(kind=shape["kind"], backend=backend, context=context)
                reason = None
                try:
                    with stopwatch() as took:
                        t, inner, v_read = measure(make, shape, context, dtype, device, repeats)
                except Exception as e:  # a kernel that does not take the shape (or OOM)
                    reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                if reason is not None:  # the failed call's tensors are released by now
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    yield {"name": "decode_attention_gpu_skip", **where, **shape, "reason": reason}
                    break
                spent += took.seconds
                nbytes = kv_bytes(context, shape["kv_heads"], shape["k_width"], v_read, elem)
                rate = nbytes / t
                yield {
                    "name": "decode_attention_gpu",
                    **where,
                    **{k: v for k, v in shape.items() if k != "kind"},
                    "v_width": v_read,
                    "dtype": str(dtype).removeprefix("torch."),
                    "elem_bytes": elem,
                    "repeats": repeats,
                    "inner": inner,
                    "time_s": t,
                    "kv_bytes": nbytes,
                    "bytes_per_s": rate,
                    "peak_bytes_per_s": peak,
                    "hbm_fraction": rate / peak if peak else None,
                    **base,
                }
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if t * inner > SLOW_S:
                    break


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the only output format)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--store", action="store_true", help=f"write the rows to {RESULTS.name}")
    p.add_argument("--repeats", type=int, default=None, help="samples per row (GPU 10, CPU 2)")
    p.add_argument("--max-context", type=int, default=None, help="drop longer contexts")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop the grid after this")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    contexts = GPU_CONTEXTS if gpu else CPU_CONTEXTS
    if a.max_context:
        contexts = tuple(c for c in contexts if c <= a.max_context)
    repeats = a.repeats or (10 if gpu else 2)
    if not gpu:
        torch.set_num_threads(1)
    out = [{"name": "machine", **machine_record(device)}]
    print(json.dumps(out[0]), flush=True)
    for row in rows(device, contexts, repeats, a.budget_s):
        out.append(row)
        print(json.dumps(row), flush=True)
    if a.store:
        if not gpu:
            print("not stored: the stored file is a GPU run", file=sys.stderr)
            return
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("".join(json.dumps(r) + "\n" for r in out))
        print(f"stored in {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
