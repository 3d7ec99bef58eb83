"""The mini engine (chapter 9) against transformers' ``generate``, and its deployments.

    python bench/engine.py --json            # about 22 minutes on 2 cores; --quick: 1
    python bench/engine.py --json --configs  # also the per-deployment rows

Prints, after a ``{"name": "engine_run", "date_utc": ..., "machine": ...}`` line:

* ``{"name": "engine_vs_hf", "model", "batch", "prompt_len", "new_tokens", "cpu_s",
  "hf_cpu_s", "ratio", "decode_step_ms", "hf_decode_step_ms", "decode_ratio",
  "tokens_match"}``: one process, one thread, float32, CPU time (``time.process_time``, so
  other load on the machine cancels): a random-initialised Hugging Face checkpoint
  (:data:`HF_MODELS`, Llama- and Qwen3-shaped, saved with ``save_pretrained`` and loaded by
  :func:`cpbook.engine.hf.from_pretrained`) served by the engine against ``generate`` on the
  same prompts, greedy, exactly ``new_tokens`` each (the checkpoint has no EOS: no
  ``min_new_tokens``, which would mask one logit in ``generate`` only).  ``ratio`` = ``generate``'s
  CPU seconds / the engine's for the whole run; ``decode_ratio`` the same for one decode step
  (``generate``: the median CPU time between two tokens, read by a stopping criterion that
  never stops; the engine: the median of its all-decode steps).  ``bare_decode_step_ms``:
  the same model's decode maths with nothing around it (:func:`bare_decode_step`), and
  ``bare_decode_ratio`` = ``generate``'s step / that, the most ``decode_ratio`` could be
  (fixed prompt lengths only).  Batch 1, 8, 32 x prompts of 32
  and 512 tokens, and batch 8 of mixed lengths 5..512 (``generate`` pads them); the least of
  ``--repeats`` rounds taken in turns (load on the machine only ever adds time).
* Every number is the median over ``--passes`` whole passes (``passes`` in each row), minutes
  apart: on a shared machine both engines' CPU times move together by more between passes
  than between the rounds of one (three passes on one tree: the engine's decode step at
  batch 8, prompt 32, 2.33, 2.89 and 3.46 ms, the ratio 1.12, 1.25 and 1.36).
* ``{"name": "engine_dcp_cpu", ...}``: CPU seconds of TP 2 x DCP 2 on simulated ranks (threads
  of this process) against one rank, same tokens; one row on a 256-wide checkpoint (the
  ``engine_vs_hf`` width, where a decode step's matrix products take tens of microseconds each,
  so halving them saves little) and one 1024 wide (TinyLlama's proportions at half its width, where
  the products are most of the step).
* ``{"name": "engine_targets", ...}``: decode step >= 1.2x at batch 8 and 32 for prompts of 32
  and 512, whole run >= 1.0x at batch >= 8 and >= 1.5x on mixed lengths, TP 2 x DCP 2 <= 1.5x
  one rank's CPU (per checkpoint): met or not.
* with ``--configs``: per deployment ``{"name": "engine", ...}`` (tokens/s of one
  :func:`cpbook.timing.serve_timing` run, inline), ``engine_capacity`` and
  ``engine_decode_overhead`` (the engine's decode steps against a plain
  :func:`cpbook.engine.models.reference_forward` loop).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time

import torch
import transformers

from cpbook.core.launch import run
from cpbook.demos.ch09_engine import max_concurrent_long_requests
from cpbook.engine.config import CacheConfig, SchedulerConfig, load_model
from cpbook.engine.engine import Engine, engine_config, serve_rank, single_rank_context
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
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
    ),
    "qwen3-h256-l4": (
        "Qwen3ForCausalLM",
        dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=1024),
    ),
    # one KV head, so GQA accepts DCP 2 inside TP 2 (the simulated-ranks rows)
    "llama-mqa-h256-l4": (
        "LlamaForCausalLM",
        dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=1024),
    ),
    # TinyLlama-1.1B's proportions (head size 64, MLP 2.75x) at half its width, 4 layers
    "llama-mqa-h1024-l4": (
        "LlamaForCausalLM",
        dict(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=1, max_position_embeddings=1024),
    ),
}  # fmt: skip


def hf_checkpoint(name: str) -> tuple[transformers.PreTrainedModel, str]:
    """``HF_MODELS[name]`` random-initialised (weights widened so greedy decoding is not
    degenerate), saved with ``save_pretrained`` to a temporary folder; the model has no EOS
    (``generate`` always makes ``max_new_tokens``, as the engine does)."""
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
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, folder


def engine_times(
    model: TinyModel, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], float, float]:
    """One engine run (every prompt's prefill in the first step): its tokens, CPU seconds of
    the whole run and of one all-decode step (the median)."""
    lens = [len(p) for p in prompts]
    blocks = sum(-(-(n + new_tokens) // 16) for n in lens) + 4
    eng = Engine(
        model,
        cache_config=CacheConfig(block_size=16, num_gpu_blocks=blocks),
        scheduler_config=SchedulerConfig(len(prompts), max_num_batched_tokens=sum(lens)),
    )
    ids = [eng.add_request(p, new_tokens) for p in prompts]
    total, decode = 0.0, []
    while eng.has_unfinished:
        with stopwatch(clock="process") as t:
            rec = eng.step()
        total += t.seconds
        if all(c.kind == "decode" for c in rec.chunks):
            decode.append(t.seconds)
    return [list(eng.output(i).tokens) for i in ids], total, statistics.median(decode)


class _TokenClock(transformers.StoppingCriteria):
    """Reads the CPU clock each time ``generate`` has a new token; never stops it."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw) -> torch.Tensor:
        self.times.append(time.process_time())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def hf_times(
    hf: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int
) -> tuple[list[list[int]], float, float]:
    """``generate`` on the same prompts (left-padded, with the attention mask): its tokens,
    CPU seconds of the whole run and of one decode step (the median between two tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _TokenClock()
    with torch.no_grad(), stopwatch(clock="process") as t:
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            stopping_criteria=[clock],
        )
    step = statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))
    return out[:, width:].tolist(), t.seconds, step


def bare_decode_step(model: TinyModel, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Median CPU seconds of one decode step of the engine's own maths with nothing around it:
    the model's projections, RoPE, norms, MLP and LM head (the same prepared weights), the new
    keys written in place into a preallocated contiguous cache, one attention call per layer
    for the batch, the greedy pick read on the host.  No scheduler, paged cache or metadata.
    ``batch`` prompts of ``prompt_len`` tokens (their keys random: only the time counts)."""
    cfg = model.config
    heads, kv_heads = slice(0, cfg.num_q_heads), slice(0, cfg.num_kv_heads)
    cols = model.mlp_shard(0, 1)
    size, hkv, d = prompt_len + new_tokens, cfg.num_kv_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(3)
    keys = [torch.randn(batch, hkv, size, d, generator=gen) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn(batch, hkv, size, d, generator=gen) for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(cfg.vocab_size, (batch,), generator=gen)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    times = []
    with torch.inference_mode():
        for pos in range(prompt_len, size):
            with stopwatch(clock="process") as t:
                positions = torch.full((batch,), pos)
                x = model.embed[ids]
                for layer in range(cfg.num_hidden_layers):
                    h = model.attn_input(layer, x)
                    q, k, v = model.qkv(layer, h, positions, heads, kv_heads)
                    keys[layer][:, :, pos], values[layer][:, :, pos] = k, v
                    out, _ = flash(
                        q.view(batch, hkv, -1, d),
                        keys[layer][:, :, : pos + 1],
                        values[layer][:, :, : pos + 1],
                        0.0,
                        False,
                        scale=model.attn_scale(layer),
                    )
                    x = x + model.o_proj(layer, out.reshape(batch, -1, d), heads)
                    x = x + model.mlp(layer, x, cols)
                ids = torch.tensor(model.logits(x).argmax(dim=-1).tolist())
            times.append(t.seconds)
    return statistics.median(times)


def engine_vs_hf(
    name: str, shapes: list[tuple[int, int | str]], new_tokens: int, repeats: int
) -> list[dict]:
    """Rows ``engine_vs_hf`` of ``HF_MODELS[name]`` (see the module docstring)."""
    hf, folder = hf_checkpoint(name)
    model = load_model(folder, "float32")
    vocab = HF_MODELS[name][1]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch, plen in shapes:
        lens = (
            torch.linspace(5, 512, batch).round().long().tolist()
            if plen == "mixed"
            else [plen] * batch
        )
        prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lens]
        eng, ref, bare = [], [], []
        for _ in range(repeats + 1):  # the first round warms every one up
            eng.append(engine_times(model, prompts, new_tokens))
            ref.append(hf_times(hf, prompts, new_tokens))
            if plen != "mixed":
                bare.append(bare_decode_step(model, batch, plen, new_tokens))
        te, th = min(e[1] for e in eng[1:]), min(r[1] for r in ref[1:])
        de, dh = min(e[2] for e in eng[1:]), min(r[2] for r in ref[1:])
        db = min(bare[1:]) if bare else None
        rows.append(
            {
                "name": "engine_vs_hf",
                "model": name,
                "batch": batch,
                "prompt_len": plen,
                "new_tokens": new_tokens,
                "cpu_s": round(te, 4),
                "hf_cpu_s": round(th, 4),
                "ratio": round(th / te, 3),
                "decode_step_ms": round(1e3 * de, 3),
                "hf_decode_step_ms": round(1e3 * dh, 3),
                "decode_ratio": round(dh / de, 3),
                "bare_decode_step_ms": None if db is None else round(1e3 * db, 3),
                "bare_decode_ratio": None if db is None else round(dh / db, 3),
                "tokens_match": eng[0][0] == ref[0][0],
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
    return rows


#: the checkpoints of the simulated-ranks rows
DCP_MODELS = ("llama-mqa-h256-l4", "llama-mqa-h1024-l4")


def simulated_dcp_cpu(name: str, new_tokens: int, repeats: int) -> dict:
    """CPU seconds of one greedy run of ``HF_MODELS[name]`` on TP 2 x DCP 2 (two simulated
    ranks, threads of this process) against the same run on one rank, same prompts."""
    _, folder = hf_checkpoint(name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1024, (n,), generator=gen).tolist() for n in (64, 128, 256, 512)]
    work = {"prompts": prompts, "max_new_tokens": new_tokens}
    cache = {"block_size": 16, "num_gpu_blocks": 128}
    sched = {"max_num_seqs": 4, "max_num_batched_tokens": 1024}
    times: dict[int, list[float]] = {1: [], 2: []}
    toks = {}
    for _ in range(repeats + 1):
        for tp in (1, 2):
            par = {"tensor_parallel_size": tp, "decode_context_parallel_size": tp}
            kw = dict(
                model=folder,
                parallel_config=par,
                cache_config=cache,
                scheduler_config=sched,
                runner_config={"dtype": "float32"},
                workload=work,
            )
            with stopwatch(clock="process") as t, contextlib.redirect_stdout(io.StringIO()):
                res = run(serve_rank, tp, "inline", kw, report=False)
            times[tp].append(t.seconds)
            toks[tp] = res[0]["tokens"]
    one, two = (min(times[w][1:]) for w in (1, 2))
    return {
        "name": "engine_dcp_cpu",
        "model": name,
        "tp": 2,
        "dcp": 2,
        "cpu_s": round(two, 4),
        "one_rank_cpu_s": round(one, 4),
        "ratio": round(two / one, 3),
        "tokens_match": toks[1] == toks[2],
    }


#: (batch, prompt length) rows of engine_vs_hf; "mixed": lengths 5..512 spread evenly
SHAPES = [(1, 32), (8, 32), (32, 32), (1, 512), (8, 512), (32, 512), (8, "mixed")]
QUICK_SHAPES = [(1, 32), (8, 32), (32, 32), (8, 512), (8, "mixed")]


def targets(rows: list[dict], dcp_rows: list[dict]) -> dict:
    """The speed targets, met or not: decode step >= 1.2x ``generate`` at batch 8 and 32 for
    both prompt lengths (32 and 512), whole run >= 1.0x at batch >= 8 and >= 1.5x on mixed
    lengths, TP2 x DCP2 <= 1.5x (per checkpoint)."""
    big = [r for r in rows if r["batch"] >= 8]
    fixed = [r for r in big if r["prompt_len"] != "mixed"]
    mixed = [r for r in big if r["prompt_len"] == "mixed"]
    return {
        "name": "engine_targets",
        "decode_ge_1.2": min(r["decode_ratio"] for r in fixed) >= 1.2,
        "run_ge_1.0": min(r["ratio"] for r in fixed) >= 1.0,
        "mixed_ge_1.5": min(r["ratio"] for r in mixed) >= 1.5,
        "dcp_cpu_le_1.5": {r["model"]: r["ratio"] <= 1.5 for r in dcp_rows},
        "min_decode_ratio": min(r["decode_ratio"] for r in fixed),
        "min_run_ratio": min(r["ratio"] for r in fixed),
        "min_mixed_ratio": min(r["ratio"] for r in mixed),
    }


def median_of_passes(passes: list[list[dict]]) -> list[dict]:
    """Row by row, the median over ``passes`` (each a list of the same rows, in order) of every
    measured number: a ratio is the median of the passes' ratios, each paired within its
    pass; ``tokens_match`` holds if it held in every pass."""
    out = []
    for same in zip(*passes, strict=True):
        row = dict(same[0], passes=len(same))
        for k, v in same[0].items():
            if isinstance(v, float):
                row[k] = round(statistics.median(r[k] for r in same), 4)
        row["tokens_match"] = all(r["tokens_match"] for r in same)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--quick", action="store_true", help="fewer rows, tokens and repeats")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--passes", type=int, default=3, help="whole passes, each row's median kept")
    p.add_argument("--device", default="cpu", help="the simulated ranks' device (cuda:0: a GPU)")
    p.add_argument("--configs", action="store_true", help="also the per-deployment rows")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps({"name": "engine_run", **machine_record(a.device, "inline")}), flush=True)
    repeats, new_tokens, passes = (1, 16, 1) if a.quick else (a.repeats, 32, a.passes)
    runs = []
    for _ in range(passes):
        rows = []
        for name in ("llama-h256-l4", "qwen3-h256-l4"):
            rows += engine_vs_hf(name, QUICK_SHAPES if a.quick else SHAPES, new_tokens, repeats)
        for name in DCP_MODELS:
            rows.append(simulated_dcp_cpu(name, new_tokens, repeats))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        runs.append(rows)
    rows = median_of_passes(runs)
    for r in rows:
        print(json.dumps(r), flush=True)
    speed = [r for r in rows if r["name"] == "engine_vs_hf"]
    dcp_rows = [r for r in rows if r["name"] == "engine_dcp_cpu"]
    print(json.dumps(targets(speed, dcp_rows)), flush=True)
    if a.configs:
        configs(a)


def configs(a: argparse.Namespace) -> None:
    """The per-deployment rows: tokens/s of the tiny models, capacity, decode overhead."""
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
