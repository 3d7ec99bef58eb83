"""cpbook's GPU-side cost model beside NVIDIA's AIConfigurator, case by case.

    python -m venv .aic && . .aic/bin/activate
    pip install torch==2.13.0 aiconfigurator==0.12.0 && pip install --no-deps -e .
    python bench/vs_aiconfigurator.py --json [--store bench/results/vs_aiconfigurator.jsonl]

AIConfigurator (``aiconfigurator`` on PyPI, CPU-only at run time) predicts TTFT and TPOT from
kernel tables measured on H100 and H200 SXM; it is an optional peer, not a dependency of the
book or of ``.ci/run``.  For every case both predict the same *static* batch with the vLLM
backend: ``batch`` prompts of ``isl`` tokens prefilled together on each replica, then ``osl``
decode steps.  The two sides are matched as follows:

- weights and KV: bf16 KV on both sides (``kvcache_quant_mode="bfloat16"``); weights as
  cpbook's :data:`~cpbook.costmodel.specs.MODELS` store them (bf16 for Llama and Qwen3, FP8
  for DeepSeek-V3), which is also the peer's default for those checkpoints; a ``-FP8`` name
  (:data:`FP8`) has FP8 block-scaled weights on both sides;
- layouts: TP ``t`` is the peer's ``tp_size=t`` (MoE: ``moe_tp_size=t``); DP × EP is its
  ``attention_dp_size=dp, moe_ep_size=dp`` with ``tp_size=1`` (cpbook's
  ``Deployment(dp=dp, ep=True)``); the peer's ``batch_size`` is per DP rank, cpbook's ``batch``
  is global, so cpbook decodes ``batch × dp``;
- TTFT: the peer's is the prefill of the whole batch on one replica, each GEMM on the batch's
  tokens at once; cpbook's is :func:`~cpbook.costmodel.latency.batch_ttft` of ``batch``
  prompts;
- TPOT: the peer averages the ``osl`` steps; cpbook's :func:`~cpbook.costmodel.latency.tpot`
  is evaluated at the mean context ``isl + osl / 2``.

A case runs only where cpbook's memory model holds the batch (``max_concurrency``).

Two sets: the *fitting set* (:data:`PEER_MODELS` at :data:`ISLS` x :data:`BATCHES`), the cases
``cpbook/costmodel/gpu_terms.py``'s terms were read off, and the *held-out set*
(:data:`HELD_OUT_MODELS` at :data:`HELD_OUT_ISLS` x :data:`HELD_OUT_BATCHES`, with one more MoE
layout: DP 8 attention with each expert split by TP over the 8 GPUs, the peer's
``attention_dp_size=8, moe_tp_size=8``), which no term was read off.  Kimi-K2 and Mixtral are
not among them: Kimi-K2's FP8 weights do not fit 8 H200s in cpbook's memory model and the peer
has no cross-node EP data for the vLLM backend; the peer fetches Mixtral's config from the
network.
Held-out rows are named ``vs_aic_held_out`` and summarised per model
(``vs_aic_held_out_summary``); ``vs_aic_family`` lines give both sets' errors per model family
(dense, MoE).

Aggregated mode (continuous batching with chunked prefill, ``--agg`` cases, H200, one layout
per model): the peer's ``mode="agg"`` with ``batch_size`` = concurrency and its default
``ctx_tokens`` (= ``isl``) against cpbook's ``tpot(..., concurrency,
batching=ContinuousBatching(isl, osl, max_num_batched_tokens=isl))``; rows
``{"name": "vs_aic_agg", ..., "osl", "concurrency", "tpot_ms", "aic_tpot_ms", "tpot_ratio",
"static_tpot_ms"}`` and one ``vs_aic_agg_summary``.

Prints one line per case ``{"name": "vs_aic", "model", "gpu", "layout", "isl", "batch", "ttft_ms",
"aic_ttft_ms", "tpot_ms", "aic_tpot_ms", "ttft_ratio", "tpot_ratio"}`` (ratios are cpbook /
peer), then per model ``{"name": "vs_aic_summary", "model", "family", "cases", "aic_vllm_db",
"ttft_median_abs_err", "ttft_worst_abs_err", "tpot_median_abs_err", "tpot_worst_abs_err"}``
with ``abs_err = |ratio - 1|`` (``aic_vllm_db``: the vLLM version of the kernel tables),
after a header line naming the peer's version.
The peer's tables end near 128K tokens of context and at batch sizes it profiled: the cases
stop at ``isl`` 128K, and nothing here covers longer contexts.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from cpbook import costmodel as cm
from cpbook.planner.hf_config import model_from_hf_config

#: cpbook's model name -> the peer's Hugging Face id (shipped with the peer, no network): the
#: fitting set, the models the GPU-side terms of ``gpu_terms.py`` were read off
PEER_MODELS = {
    "Llama-3.1-8B": "meta-llama/Meta-Llama-3.1-8B",
    "Llama-3.1-70B": "meta-llama/Meta-Llama-3.1-70B",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
    "DeepSeek-V3": "deepseek-ai/DeepSeek-V3",
    "Llama-3.1-70B-FP8": "meta-llama/Meta-Llama-3.1-70B",
}
#: the held-out set: models no term was read off (cpbook's spec from its built-in table, else
#: from the ``config.json`` the peer ships), at other prompt lengths and batch sizes
HELD_OUT_MODELS = {
    "Qwen3-32B": "Qwen/Qwen3-32B",
    "Llama-3.1-405B": "meta-llama/Meta-Llama-3.1-405B",
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "Llama-3.1-405B-FP8": "meta-llama/Meta-Llama-3.1-405B",
    "Qwen3-32B-FP8": "Qwen/Qwen3-32B-FP8",
    "Qwen3-30B-A3B-FP8": "Qwen/Qwen3-30B-A3B-FP8",
}
#: a ``-FP8`` name of a bf16 checkpoint: its weights FP8 block-scaled on both sides (the peer's
#: ``gemm_quant_mode="fp8_block"``, cpbook's spec at one byte per weight)
FP8 = "-FP8"
#: FP8 block-scaled weights are stored in blocks of this many rows and columns
FP8_BLOCK = 128
PEER_SYSTEMS = {"H200": "h200_sxm", "H100": "h100_sxm"}
ISLS = (4096, 32768, 131072)
BATCHES = (1, 8, 32, 64)
HELD_OUT_ISLS = (2048, 8192, 65536)
HELD_OUT_BATCHES = (2, 16, 128)
OSL = 256
#: aggregated-mode cases: one TP layout per model, 4K prompts, two output lengths
AGG_LAYOUTS = {"Llama-3.1-8B": 1, "Llama-3.1-70B": 8, "Qwen3-235B-A22B": 8, "DeepSeek-V3": 8}
AGG_OSLS = (256, 1024)
AGG_CONCURRENCY = (8, 32, 96)


@dataclass(frozen=True)
class Case:
    model: str
    gpu: str
    layout: cm.Deployment
    isl: int
    batch: int  #: per replica, as the peer counts it

    @property
    def moe(self) -> bool:
        return bool(model_spec(self.model).expert_params)


@functools.cache
def model_spec(name: str) -> cm.ModelSpec:
    """cpbook's spec of ``name``: the built-in one, else read from the peer's ``config.json``;
    a ``-FP8`` name of a bf16 model at one byte per weight."""
    base = name.removesuffix(FP8)
    if base != name and base in cm.MODELS:
        return replace(cm.get_model(base), name=name, weight_bytes_per_param=1)
    if name in cm.MODELS:
        return cm.get_model(name)
    from aiconfigurator_core import __file__ as core

    org, model = {**PEER_MODELS, **HELD_OUT_MODELS}[name].split("/")
    path = Path(core).parent / "model_configs" / f"{org}--{model}_config.json"
    return model_from_hf_config(json.loads(path.read_text()), name=name)


def layouts(model: str, held_out: bool = False) -> list[cm.Deployment]:
    """TP 1-8 for dense models (held out: TP 2-8); TP 4/8 and DP8 x EP8 for MoE models, and
    held out also TP 2 and DP 8 attention with each expert split by TP over the 8 GPUs.  FP8
    block-scaled experts split by TP must keep whole :data:`FP8_BLOCK` blocks (the peer refuses
    other splits)."""
    spec = model_spec(model)
    if spec.expert_params:
        moe = [cm.Deployment(tp=4), cm.Deployment(tp=8), cm.Deployment(dp=8, ep=True)]
        if held_out:
            moe = [cm.Deployment(tp=2), *moe, cm.Deployment(dp=8)]
        width = spec.expert_size_params / (3 * spec.hidden_size)
        fp8 = spec.weight_bytes_per_param <= 1
        return [x for x in moe if not fp8 or width / x.moe_tp % FP8_BLOCK == 0]
    return [cm.Deployment(tp=t) for t in ((2, 4, 8) if held_out else (1, 2, 4, 8))]


def cases(models: list[str], gpus: list[str], held_out: bool = False) -> list[Case]:
    """Every (model, GPU, layout, isl, batch) whose batch fits cpbook's memory model, at the
    fitting set's prompt lengths and batches or the held-out set's."""
    isls, batches = (HELD_OUT_ISLS, HELD_OUT_BATCHES) if held_out else (ISLS, BATCHES)
    out = []
    for name in models:
        spec = model_spec(name)
        for gpu in gpus:
            for layout in layouts(name, held_out):
                for isl in isls:
                    try:
                        fits = cm.max_concurrency(spec, cm.get_gpu(gpu), layout, isl + OSL)
                    except ValueError:  # the weights alone do not fit
                        continue
                    out += [
                        Case(name, gpu, layout, isl, b) for b in batches if b * layout.dp <= fits
                    ]
    return out


def cpbook_ms(case: Case) -> tuple[float, float]:
    """cpbook's TTFT and TPOT of ``case`` in milliseconds (see the module docstring)."""
    spec, gpu = model_spec(case.model), cm.get_gpu(case.gpu)
    ttft = cm.batch_ttft(spec, gpu, case.layout, case.isl, case.batch).total_s
    step = cm.tpot(spec, gpu, case.layout, case.isl + OSL // 2, case.batch * case.layout.dp)
    return ttft * 1e3, step.total_s * 1e3


def peer_ms(case: Case, mode: str = "static", osl: int = OSL) -> tuple[float, float, str]:
    """The peer's TTFT and TPOT of ``case`` in milliseconds (``mode`` "static" or "agg"), and
    the version of vLLM its kernel tables were measured with."""
    from aiconfigurator.cli.api import cli_estimate

    lay = case.layout
    if case.moe:  # the experts over the whole pool: EP, or split by TP
        ep = lay.num_gpus if lay.ep else 1
        par = dict(tp_size=lay.tp, attention_dp_size=lay.dp, moe_tp_size=lay.moe_tp, moe_ep_size=ep)
    else:
        par = dict(tp_size=lay.tp)
        if case.model.endswith(FP8):
            par["gemm_quant_mode"] = "fp8_block"
    r = cli_estimate(
        {**PEER_MODELS, **HELD_OUT_MODELS}[case.model],
        PEER_SYSTEMS[case.gpu],
        mode=mode,
        backend_name="vllm",
        isl=case.isl,
        osl=osl,
        batch_size=case.batch,
        kvcache_quant_mode="bfloat16",
        **par,
    )
    return float(r.ttft), float(r.tpot), str(r.backend_version)


def agg_rows() -> list[dict]:
    """cpbook's TPOT under continuous batching beside the peer's aggregated mode."""
    rows = []
    for model, tp in AGG_LAYOUTS.items():
        spec, gpu, lay = cm.get_model(model), cm.get_gpu("H200"), cm.Deployment(tp=tp)
        isl = 4096
        for osl, n in ((o, c) for o in AGG_OSLS for c in AGG_CONCURRENCY):
            batching = cm.ContinuousBatching(isl, osl, max_num_batched_tokens=isl)
            step = cm.tpot(spec, gpu, lay, isl + osl // 2, n, batching=batching)
            _, aic, _ = peer_ms(Case(model, "H200", lay, isl, n), "agg", osl)
            rows.append(
                {
                    "name": "vs_aic_agg",
                    "model": model,
                    "gpu": "H200",
                    "layout": lay.label,
                    "isl": isl,
                    "osl": osl,
                    "concurrency": n,
                    "tpot_ms": round(step.total_s * 1e3, 4),
                    "static_tpot_ms": round(step.step_s * 1e3, 4),
                    "aic_tpot_ms": round(aic, 4),
                    "tpot_ratio": round(step.total_s * 1e3 / aic, 3),
                }
            )
    return rows


def family(model: str) -> str:
    return "moe" if model_spec(model).expert_params else "dense"


def errors(rows: list[dict]) -> dict:
    """Median and worst ``|ratio - 1|`` of ``rows``' TTFT and TPOT."""
    ttft = [abs(r["ttft_ratio"] - 1) for r in rows]
    tpot = [abs(r["tpot_ratio"] - 1) for r in rows]
    return {
        "cases": len(rows),
        "ttft_median_abs_err": round(statistics.median(ttft), 3),
        "ttft_worst_abs_err": round(max(ttft), 3),
        "tpot_median_abs_err": round(statistics.median(tpot), 3),
        "tpot_worst_abs_err": round(max(tpot), 3),
    }


def summary(model: str, rows: list[dict], db: str, name: str = "vs_aic_summary") -> dict:
    """Median and worst ``|ratio - 1|`` of one model's rows."""
    head = {"name": name, "model": model, "family": family(model)}
    return {**head, "cases": len(rows), "aic_vllm_db": db, **errors(rows)}


def compare(todo: list[Case], name: str) -> tuple[dict[str, list[dict]], str]:
    """One row per case, printed as it comes, grouped by model; and the peer's vLLM version."""
    by_model: dict[str, list[dict]] = {}
    db = ""
    for case in todo:
        ttft, step = cpbook_ms(case)
        aic_ttft, aic_step, db = peer_ms(case)
        row = {
            "name": name,
            "model": case.model,
            "gpu": case.gpu,
            "layout": case.layout.label,
            "isl": case.isl,
            "batch": case.batch,
            "ttft_ms": round(ttft, 3),
            "aic_ttft_ms": round(aic_ttft, 3),
            "tpot_ms": round(step, 4),
            "aic_tpot_ms": round(aic_step, 4),
            "ttft_ratio": round(ttft / aic_ttft, 3),
            "tpot_ratio": round(step / aic_step, 3),
        }
        by_model.setdefault(case.model, []).append(row)
        print(json.dumps(row), flush=True)
    return by_model, db


def family_summaries(sets: dict[str, dict[str, list[dict]]]) -> list[dict]:
    """Per set (``fit``, ``held_out``) and model family (dense, MoE): the errors of its rows."""
    out = []
    for name, by_model in sets.items():
        for fam in ("dense", "moe"):
            rows = [r for m, rs in by_model.items() if family(m) == fam for r in rs]
            if rows:
                out.append({"name": "vs_aic_family", "set": name, "family": fam, **errors(rows)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--models", nargs="+", default=list(PEER_MODELS), choices=list(PEER_MODELS))
    p.add_argument("--gpus", nargs="+", default=list(PEER_SYSTEMS), choices=list(PEER_SYSTEMS))
    p.add_argument("--store", type=Path, help="also write the lines to this file")
    p.add_argument("--no-agg", action="store_true", help="skip the aggregated-mode cases")
    p.add_argument("--no-held-out", action="store_true", help="skip the held-out cases")
    a = p.parse_args(argv)
    try:
        from importlib.metadata import version

        peer_version = version("aiconfigurator")
    except Exception as e:  # the peer is optional: say how to get it
        raise SystemExit(f"vs_aiconfigurator: {e}; install it as the docstring says") from e
    logging.disable(logging.WARNING)  # the peer logs its database loads at INFO/WARNING
    lines = [{"name": "vs_aic_peer", "aiconfigurator": peer_version, "backend": "vllm"}]
    print(json.dumps(lines[0]), flush=True)
    by_model, db = compare(cases(a.models, a.gpus), "vs_aic")
    held: dict[str, list[dict]] = {}
    if not a.no_held_out:
        held, _ = compare(cases(list(HELD_OUT_MODELS), a.gpus, True), "vs_aic_held_out")
    lines += [r for rows in (*by_model.values(), *held.values()) for r in rows]
    summaries = [summary(m, rows, db) for m, rows in by_model.items()]
    summaries += [summary(m, rows, db, "vs_aic_held_out_summary") for m, rows in held.items()]
    summaries += family_summaries({"fit": by_model, "held_out": held})
    if not a.no_agg:
        agg = agg_rows()
        err = [abs(r["tpot_ratio"] - 1) for r in agg]
        summaries += agg
        summaries.append(
            {
                "name": "vs_aic_agg_summary",
                "cases": len(agg),
                "tpot_median_abs_err": round(statistics.median(err), 3),
                "tpot_worst_abs_err": round(max(err), 3),
            }
        )
    for line in summaries:
        print(json.dumps(line))
    lines += summaries
    if a.store:
        a.store.write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
