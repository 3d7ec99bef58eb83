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
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbook.costmodel import gpu_terms as gt
from cpbook.costmodel.decode import decode_break_even, kv_read_efficiency
from cpbook.costmodel.knobs import DEFAULT_HBM_EFFICIENCY
from cpbook.costmodel.latency import tpot_break_even
from cpbook.costmodel.memory import Deployment
from cpbook.costmodel.specs import LINKS, GPUSpec, ModelSpec, get_gpu, get_model

__all__ = [
    "DECODE_MODELS",
    "HEADLINE_DECODE_MODEL",
    "BreakEven",
    "break_even_table",
    "headline_break_even",
]

#: the book's two decode models, headline first: name → what its KV read is
DECODE_MODELS = {
    "whole-model": "whole-model TPOT, occupancy-bound KV read",
    "per-layer": "one layer's attention, bandwidth-bound KV read",
}
#: the model whose numbers the book quotes as *the* break-even: what a deployer sees as TPOT
HEADLINE_DECODE_MODEL = "whole-model"


@dataclass(frozen=True)
class BreakEven:
    """One row of :func:`break_even_table`: above ``tokens`` of context per request, TP +
    DCP (``tpa``: with query replication) decodes faster than TP alone with ``num_reqs``
    requests in the step, in ``decode_model``; ``kv_read_efficiency`` is the fraction of HBM
    bandwidth that model streams the KV at for this row; ``dcp_alpha_s`` and
    ``allreduce_alpha_s`` the latencies of DCP's collectives and of the decode all-reduce."""

    decode_model: str
    num_reqs: int
    tpa: bool
    tokens: float
    kv_read_efficiency: float
    dcp_alpha_s: float
    allreduce_alpha_s: float

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
) -> tuple[BreakEven, ...]:
    """The DCP decode break-even of ``model`` on ``gpu`` (TP ``tp`` + DCP ``dcp`` against TP
    ``tp`` alone): one row per decode model (:data:`DECODE_MODELS`, headline first) × request
    count in ``batches`` × {DCP, DCP + TPA}.  The whole-model rows are
    :func:`~cpbook.costmodel.latency.tpot_break_even` (to 256 tokens), the per-layer rows
    :func:`~cpbook.costmodel.decode.decode_break_even` (exact)."""
    m = get_model(model) if isinstance(model, str) else model
    g = get_gpu(gpu) if isinstance(gpu, str) else gpu
    kv_heads = 1 if m.use_mla else max(m.num_kv_heads // tp, 1)
    alphas = {
        "dcp_alpha_s": LINKS["NVLink4"].alpha_s,
        "allreduce_alpha_s": gt.DECODE_ALLREDUCE_ALPHA_S,
    }
    rows = []
    for b in batches:
        for tpa in (False, True):
            lay = Deployment(tp=tp, dcp=dcp, tpa=tpa)
            tokens = tpot_break_even(m, g, lay, Deployment(tp=tp), b)
            eff = kv_read_efficiency(DEFAULT_HBM_EFFICIENCY, b, kv_heads)
            rows.append(BreakEven("whole-model", b, tpa, tokens, eff, **alphas))
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
