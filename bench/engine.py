"""The mini engine (chapter 9): throughput, capacity under DCP, and paging overhead.

    python bench/engine.py --json
    python bench/engine.py --json --device cuda:0     # every simulated rank on one GPU

Prints, after a ``{"name": "engine_run", "date_utc": ..., "machine": ...}`` line:

* per configuration ``{"name": "engine", "model", "tp", "dcp", "pcp", "requests",
  "tokens_per_s", "max_concurrent_long_requests"}``: ``tokens_per_s`` from one
  :func:`cpbook.timing.serve_timing` run (inline: simulated ranks are threads of one process,
  so multi-rank rates measure the simulation, not a cluster); ``max_concurrent_long_requests``:
  requests of ``LONG`` tokens admitted into an empty cache of ``BLOCKS`` blocks of
  ``block_size`` 16 per rank until the scheduler stops admitting;
* ``{"name": "engine_capacity", "model", "dcp1", "dcp4", "ratio"}`` (target: ratio >= 4);
* ``{"name": "engine_decode_overhead", "model", "batch": 8, "engine_tokens_per_s",
  "plain_tokens_per_s", "ratio"}``: one rank, 8 requests all decoding, the engine's decode
  steps against a plain loop of :func:`cpbook.engine.models.reference_forward` (one request at a
  time, contiguous KV cache) over the same tokens; medians of ``--repeats`` rounds, taken in turns
  (target: ratio >= 0.5);
* ``{"name": "engine_vs_hf", "model", "batch", "prompt_len", "new_tokens", "tokens_per_s",
  "hf_tokens_per_s", "ratio", "tokens_match"}``: one rank, a random-initialised Hugging Face
  model (:data:`HF_MODELS`, saved with ``save_pretrained`` to a temporary folder and loaded by
  :func:`cpbook.engine.hf.from_pretrained`) against ``transformers``' ``generate`` on the same
  folder: float32, greedy, ``batch`` prompts of ``prompt_len`` tokens, ``new_tokens`` each,
  batch 1 and 8; medians of ``--repeats`` rounds taken in turns (target: ratio >= 1.0 at batch
  8).  ``tokens_match``: the two picked the same tokens.

One intra-op thread (tiny tensors; several threads only contend on a shared CPU) unless
``--threads``; both engines of a comparison run with the same count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import transformers

from cpbook.core.launch import run
from cpbook.demos.ch09_engine import max_concurrent_long_requests
from cpbook.engine.config import CacheConfig, RunnerConfig, SchedulerConfig
from cpbook.engine.engine import Engine, engine_config, single_rank_context
from cpbook.engine.models import TinyModel, reference_forward
from cpbook.timing import machine_record, serve_timing, stopwatch

BLOCKS, LONG = 64, 255
CONFIGS = [
    ("tiny-gqa", 1, 1, 1),
    ("tiny-mla", 1, 1, 1),
    ("tiny-gqa", 4, 1, 1),
    ("tiny-gqa", 4, 2, 1),
    ("tiny-mla", 4, 1, 1),
    ("tiny-mla", 4, 2, 1),
    ("tiny-mla", 4, 4, 1),
    ("tiny-mla", 2, 2, 2),
]


def capacity(model: str, tp: int, dcp: int, pcp: int) -> int:
    return max_concurrent_long_requests(
        engine_config(model, tp, dcp, pcp, block_size=16), BLOCKS, LONG
    )


def decode_overhead(
    model: str, batch: int, prompt_len: int, steps: int, repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """Median seconds per decode step of ``batch`` requests: engine vs plain reference loop,
    both on ``device`` (each step ends in a host read of its tokens, so the clock is fair)."""
    m = TinyModel.from_name(model).to(device)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(m.config.vocab_size, (prompt_len,), generator=gen).tolist()
        for _ in range(batch)
    ]
    eng_t, plain_t = [], []
    for _ in range(repeats + 1):
        eng = Engine(
            m,
            cache_config=CacheConfig(num_gpu_blocks=batch * (prompt_len + steps + 8) // 4 + 8),
            scheduler_config=SchedulerConfig(batch, max_num_batched_tokens=batch * prompt_len),
            ctx=single_rank_context(device),
        )
        ids = [eng.add_request(p, steps + 1) for p in prompts]
        eng.step()  # every prompt's prefill in one step
        assert all(eng.scheduler.requests[i].prefill_done for i in ids)
        with stopwatch() as t:
            for _ in range(steps):
                rec = eng.step()
                assert [k for _, k, _, _ in rec.chunks] == ["decode"] * batch
        eng_t.append(t.seconds / steps)
        caches = [[[] for _ in range(m.config.num_hidden_layers)] for _ in prompts]
        last = [int(reference_forward(m, p, 0, c)[-1].argmax()) for p, c in zip(prompts, caches)]
        with stopwatch() as t:
            for s in range(steps):
                for i, c in enumerate(caches):
                    last[i] = int(reference_forward(m, [last[i]], prompt_len + s, c)[-1].argmax())
        plain_t.append(t.seconds / steps)
    return {"engine": statistics.median(eng_t[1:]), "plain": statistics.median(plain_t[1:])}


HF_MODELS = {
    "llama-h256-l4": (
        "LlamaForCausalLM",
        dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512),
    ),
    "deepseek-v3-h256-l4": (
        "DeepseekV3ForCausalLM",
        dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=64, q_lora_rank=96,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
             first_k_dense_replace=1, n_group=4, topk_group=2, max_position_embeddings=512),
    ),
}  # fmt: skip


def engine_vs_hf(
    name: str, batches: tuple[int, ...], prompt_len: int, new_tokens: int, repeats: int
) -> list[dict]:
    """Rows ``engine_vs_hf`` of ``HF_MODELS[name]`` (see the module docstring)."""
    arch, kw = HF_MODELS[name]
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kw)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():  # std 0.02 init gives near-uniform logits: widen it
        for prm in hf.parameters():
            if prm.ndim > 1:
                prm.normal_(0, prm.shape[-1] ** -0.5)
    folder = tempfile.mkdtemp(prefix="cpbook-bench-hf-")
    hf.save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in batches:
        prompts = torch.randint(kw["vocab_size"], (batch, prompt_len), generator=gen)
        eng_t, hf_t = [], []
        for _ in range(repeats + 1):
            blocks = batch * (prompt_len + new_tokens) // 16 + batch + 4
            eng = Engine(
                folder,
                cache_config=CacheConfig(block_size=16, num_gpu_blocks=blocks),
                scheduler_config=SchedulerConfig(batch, max_num_batched_tokens=batch * prompt_len),
                runner_config=RunnerConfig(dtype="float32"),
            )
            with stopwatch() as t:
                outs = eng.generate(prompts.tolist(), new_tokens)
            eng_t.append(t.seconds)
            with stopwatch() as t, torch.no_grad():
                ref = hf.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                )
            hf_t.append(t.seconds)
        mine = [list(o.tokens) for o in outs]
        te, th = statistics.median(eng_t[1:]), statistics.median(hf_t[1:])
        rows.append(
            {
                "name": "engine_vs_hf",
                "model": name,
                "batch": batch,
                "prompt_len": prompt_len,
                "new_tokens": new_tokens,
                "tokens_per_s": round(batch * new_tokens / te, 1),
                "hf_tokens_per_s": round(batch * new_tokens / th, 1),
                "ratio": round(th / te, 3),
                "tokens_match": mine == ref[:, prompt_len:].tolist(),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="the simulated ranks' device (cuda:0: a GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--only-hf", action="store_true", help="only the engine_vs_hf rows")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(json.dumps({"name": "engine_run", **machine_record(a.device, "inline")}), flush=True)
    for name in HF_MODELS:
        for row in engine_vs_hf(name, (1, 8), 32, 32, a.repeats):
            print(json.dumps(row), flush=True)
    if a.only_hf:
        return
    for model, tp, dcp, pcp in CONFIGS:
        res = run(
            serve_timing,
            tp * pcp,
            "inline",
            {
                "model": model,
                "parallel_config": {
                    "tensor_parallel_size": tp,
                    "decode_context_parallel_size": dcp,
                    "prefill_context_parallel_size": pcp,
                },
                "workload": {"num_requests": a.requests, "max_new_tokens": 8},
            },
            report=False,
            device=a.device,
        )[0]
        print(
            json.dumps(
                {
                    "name": "engine",
                    "model": model,
                    "tp": tp,
                    "dcp": dcp,
                    "pcp": pcp,
                    "requests": a.requests,
                    "tokens_per_s": round(res["tokens_per_s"], 1),
                    "max_concurrent_long_requests": capacity(model, tp, dcp, pcp),
                }
            ),
            flush=True,
        )
    one, four = capacity("tiny-mla", 4, 1, 1), capacity("tiny-mla", 4, 4, 1)
    print(
        json.dumps(
            {
                "name": "engine_capacity",
                "model": "tiny-mla",
                "blocks_per_rank": BLOCKS,
                "block_size": 16,
                "request_tokens": LONG + 1,
                "dcp1": one,
                "dcp4": four,
                "ratio": four / one,
            }
        ),
        flush=True,
    )
    for model in ("tiny-gqa", "tiny-mla"):
        t = decode_overhead(model, 8, 64, 16, a.repeats, a.device)
        print(
            json.dumps(
                {
                    "name": "engine_decode_overhead",
                    "model": model,
                    "batch": 8,
                    "engine_tokens_per_s": round(8 / t["engine"], 1),
                    "plain_tokens_per_s": round(8 / t["plain"], 1),
                    "ratio": round(t["plain"] / t["engine"], 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
