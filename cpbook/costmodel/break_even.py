"""The book's one DCP decode break-even table: where TP + DCP (with or without TPA) starts to
beat plain TP per decode step, under both of the book's decode models.

* **whole-model** (the headline): :func:`~cpbook.costmodel.latency.tpot_break_even`, the
  crossing of two deployments' whole-model TPOT, whose KV read is occupancy-bound
  (:func:`~cpbook.costmodel.decode.kv_read_efficiency`: one request's single latent head per
  GPU streams at :data:`~cpbook.costmodel.gpu_terms.DECODE_ATTENTION_UNIT_EFFICIENCY` of HBM).
  It is what a deployer sees as time per output token.
* **per-layer**: :func:`~cpbook.costmodel.decode.decode_break_even`, chapter 6's model of one
  layer's decode attention, whose KV read is bandwidth-bound at
  :data:`~cpbook.costmodel.knobs.DEFAULT_HBM_EFFICIENCY` of HBM whatever the batch.  It
  isolates attention: every term DCP does not change is left out.

Both take the decode all-reduce at the CUDA-graph latency
:data:`~cpbook.costmodel.gpu_terms.DECODE_ALLREDUCE_ALPHA_S` and DCP's other collectives at the
link's α (NVLink 4, 15 µs).  Chapters 0, 6, 8 and 10 and the cheat sheet glue their numbers
from :func:`break_even_table`.

**Modelled or measured.**  The whole-model rows' one-request KV read is the modelled
``DECODE_ATTENTION_UNIT_EFFICIENCY`` until a GPU has measured it: when
``bench/results/decode_attention_gpu.jsonl`` (``python bench/decode_attention_gpu.py --json
--store`` on an H200 / H100) exists, :func:`stored_kv_read` takes from it the achieved HBM
fraction of one request's one KV head at long context, and the table uses that instead.  Each
row's ``source`` says which: ``"modelled"`` or ``"measured on <device>, <date>"`` (the
per-layer rows' bandwidth-bound read is always the modelled one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.decode import decode_break_even, kv_read_efficiency
from cpbook.costmodel.knobs import DEFAULT_HBM_EFFICIENCY, CostKnobs
from cpbook.costmodel.latency import tpot_break_even
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import LINKS, GPUSpec, ModelSpec, get_gpu, get_model

__all__ = [
    "DECODE_MODELS",
    "HEADLINE_DECODE_MODEL",
    "KV_READ_RESULTS",
    "LONG_CONTEXT",
    "MODELLED",
    "BreakEven",
    "MeasuredKVRead",
    "break_even_table",
    "headline_break_even",
    "stored_kv_read",
]

#: the book's two decode models, headline first: name → what its KV read is
DECODE_MODELS = {
    "whole-model": "whole-model TPOT, occupancy-bound KV read",
    "per-layer": "one layer's attention, bandwidth-bound KV read",
}
#: the model whose numbers the book quotes as *the* break-even: what a deployer sees as TPOT
HEADLINE_DECODE_MODEL = "whole-model"
#: where ``bench/decode_attention_gpu.py --store`` keeps its rows (absent until a GPU run)
KV_READ_RESULTS = (
    Path(__file__).resolve().parents[2] / "bench" / "results" / "decode_attention_gpu.jsonl"
)
#: the shortest context a stored row may have to stand for the break-even's long contexts
LONG_CONTEXT = 131072
#: a row's ``source`` when its KV-read efficiency is the cost model's own
MODELLED = "modelled"
#: the GPUs whose stored rows stand for the book's Hopper break-even
_HOPPER = ("H200", "H100")


@dataclass(frozen=True)
class MeasuredKVRead:
    """One request's one-KV-head KV read as measured: ``efficiency`` (the achieved HBM fraction
    of the stored row), the ``device`` and ``date_utc`` it ran on, and what ran (``kind``,
    ``backend``, ``context``, ``q_heads``)."""

    efficiency: float
    device: str
    date_utc: str
    kind: str
    backend: str
    context: int
    q_heads: int

    @property
    def source(self) -> str:
        """``"measured on <device>, <date>"``: a :class:`BreakEven` row's ``source``."""
        return f"measured on {self.device}, {self.date_utc}"


def stored_kv_read(
    model: str | ModelSpec = "DeepSeek-V3",
    gpu: str | GPUSpec = "H200",
    tp: int = 8,
    path: str | Path | None = None,
) -> MeasuredKVRead | None:
    """The measured one-request KV-read efficiency for ``model`` on ``gpu``, or None (no
    stored file, or no row that stands for it).

    Reads ``path`` (default :data:`KV_READ_RESULTS`): the ``decode_attention_gpu`` rows with an
    HBM fraction, one KV head (MLA's latent; GQA's one KV group), the model's attention
    (``"mla"`` or ``"gqa"``), on ``gpu`` (its name's first word in the device name), else on
    an H200 / H100; of those at the longest context (at least :data:`LONG_CONTEXT`), the ones
    with the model's query heads per rank (``num_q_heads // tp``) when there are any, and of
    them the fastest kernel's (vLLM runs the best it has)."""
    m = get_model(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    path = Path(KV_READ_RESULTS if path is None else path)
    if not path.exists():
        return None
    lines = (ln for ln in path.read_text().splitlines() if ln.strip())
    kind = "mla" if m.use_mla else "gqa"
    rows = [
        r
        for r in map(json.loads, lines)
        if r.get("name") == "decode_attention_gpu"
        and r.get("hbm_fraction")
        and r.get("kind") == kind
        and r.get("kv_heads") == 1
    ]
    own = g.name.split()[0]
    for names in ((own,), _HOPPER):
        near = [r for r in rows if any(n in r.get("device", "") for n in names)]
        if near:
            break
    else:
        return None
    longest = max(r["context"] for r in near)
    if longest < LONG_CONTEXT:
        return None
    near = [r for r in near if r["context"] == longest]
    q_heads = max(m.num_q_heads // tp, 1)
    near = [r for r in near if r["q_heads"] == q_heads] or near
    best = max(near, key=lambda r: r["hbm_fraction"])
    return MeasuredKVRead(
        min(float(best["hbm_fraction"]), 1.0),
        best["device"],
        best["date_utc"],
        kind,
        best["backend"],
        longest,
        best["q_heads"],
    )


@dataclass(frozen=True)
class BreakEven:
    """One row of :func:`break_even_table`: above ``tokens`` of context per request, TP +
    DCP (``tpa``: with query replication) decodes faster than TP alone with ``num_reqs``
    requests in the step, in ``decode_model``; ``kv_read_efficiency`` is the fraction of HBM
    bandwidth that model streams the KV at for this row; ``dcp_alpha_s`` and
    ``allreduce_alpha_s`` the latencies of DCP's collectives and of the decode all-reduce;
    ``source`` where the KV-read efficiency came from (:data:`MODELLED`, or
    :attr:`MeasuredKVRead.source`)."""

    decode_model: str
    num_reqs: int
    tpa: bool
    tokens: float
    kv_read_efficiency: float
    dcp_alpha_s: float
    allreduce_alpha_s: float
    source: str = MODELLED

    @property
    def label(self) -> str:
        return "DCP + TPA" if self.tpa else "DCP"

    @property
    def k_tokens(self) -> int:
        """``tokens`` in K (1,024 tokens), rounded: the form the book's prose quotes."""
        return round(self.tokens / 1024)


def break_even_table(
    model: str | ModelSpec = "DeepSeek-V3",
    gpu: str | GPUSpec = "H200",
    *,
    tp: int = 8,
    dcp: int = 8,
    batches: tuple[int, ...] = (1, 16),
    measured: MeasuredKVRead | str | None = "stored",
) -> tuple[BreakEven, ...]:
    """The DCP decode break-even of ``model`` on ``gpu`` (TP ``tp`` + DCP ``dcp`` against TP
    ``tp`` alone): one row per decode model (:data:`DECODE_MODELS`, headline first) × request
    count in ``batches`` × {DCP, DCP + TPA}.  The whole-model rows are
    :func:`~cpbook.costmodel.latency.tpot_break_even` (to 256 tokens), the per-layer rows
    :func:`~cpbook.costmodel.decode.decode_break_even` (exact).

    ``measured``: the whole-model rows' one-request KV read — ``"stored"`` (the default):
    :func:`stored_kv_read`'s measurement where one is stored, else the modelled one; ``None``:
    the modelled one; a :class:`MeasuredKVRead`: that one.  Each row's ``source`` says which."""
    m = get_model(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    kv_heads = 1 if m.use_mla else max(m.num_kv_heads // tp, 1)
    alphas = {
        "dcp_alpha_s": LINKS["NVLink4"].alpha_s,
        "allreduce_alpha_s": gt.DECODE_ALLREDUCE_ALPHA_S,
    }
    if measured == "stored":
        measured = stored_kv_read(m, g, tp)
    unit = measured.efficiency if measured else None
    knobs = CostKnobs(kv_unit_efficiency=unit)
    source = measured.source if measured else MODELLED
    rows = []
    for b in batches:
        for tpa in (False, True):
            lay = Deployment(tp=tp, dcp=dcp, tpa=tpa)
            tokens = tpot_break_even(m, g, lay, Deployment(tp=tp), b, knobs=knobs)
            eff = kv_read_efficiency(DEFAULT_HBM_EFFICIENCY, b, kv_heads, unit)
            rows.append(BreakEven("whole-model", b, tpa, tokens, eff, **alphas, source=source))
    for b in batches:
        for tpa in (False, True):
            mode = "dcp_tpa" if tpa else "dcp"
            tokens = decode_break_even(m, g, mode, tp=tp, dcp=dcp, num_reqs=b)
            rows.append(BreakEven("per-layer", b, tpa, tokens, DEFAULT_HBM_EFFICIENCY, **alphas))
    return tuple(rows)


def headline_break_even(table: tuple[BreakEven, ...], num_reqs: int = 1, tpa: bool = False):
    """The row of ``table`` the book quotes as the break-even: :data:`HEADLINE_DECODE_MODEL`,
    ``num_reqs`` requests, with or without TPA."""
    return next(
        r
        for r in table
        if r.decode_model == HEADLINE_DECODE_MODEL and r.num_reqs == num_reqs and r.tpa == tpa
    )
