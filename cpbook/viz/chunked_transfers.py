"""Chapter 5's transfer figure: what crosses between the ranks, and how many bytes, when one chunk
is prefilled by AllGather-Q or by AllGather-KV (:mod:`cpbook.pcp.chunked`).

The figure is drawn from the traces the ranks recorded (``res["comm"]`` of
:func:`cpbook.demos.ch05_chunked.chunked_prefill_rank`: one ``(op, bytes)`` per collective, what
this rank sent), so it shows what the code moved, not a sketch of it.  It covers grids whose
every collective spans all ranks: ``tp = 1`` and ``dcp`` equal to ``pcp`` or 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from matplotlib.patches import FancyArrowPatch, Rectangle

from cpbook.core.errors import RuleError
from cpbook.viz.style import figure, ink, rank_color

__all__ = ["Step", "transfer_steps", "transfers_figure"]

# inches: narrower than the 6.25 in text column at 1280 px, so that on a phone, where every
# figure is scaled to the column, its 9 pt labels shrink less
_WIDTH = 5.6
_TITLES = {"allgather_q": "AllGather-Q", "allgather_kv": "AllGather-KV"}
_COMBINE = {
    "all_to_all": "partial out + LSE",
    "all_gather": "LSEs",
    "reduce_scatter": "partial out",
}
_OP = {"all_gather": "AllGather", "all_to_all": "All2All", "reduce_scatter": "ReduceScatter"}


@dataclass(frozen=True)
class Step:
    """One collective of a rank's trace: what it carries, the op, the group, the bytes sent."""

    what: str
    op: str
    group: str
    bytes: int


def transfer_steps(
    strategy: str, comm: Sequence[tuple[str, int]], *, pcp: int, dcp: int
) -> list[Step]:
    """Name each entry of one rank's trace ``comm`` for ``strategy``.

    AllGather-Q: the queries over the attention group ``G`` (DCP if ``dcp > 1``, else PCP), then
    the combine (one All2All, or AllGather of LSEs + ReduceScatter).  AllGather-KV: the chunk's
    new K/V over PCP (if ``pcp > 1``), then one context piece per entry over DCP.  Raises
    ``ValueError`` when the trace does not have that shape."""
    ops = [op for op, _ in comm]
    if strategy == "allgather_q":
        group = "DCP" if dcp > 1 else "PCP"
        ok = ops[:1] == ["all_gather"] and ops[1:] in (
            ["all_to_all"],
            ["all_gather", "reduce_scatter"],
        )
        if ok:
            return [Step("Q rows", ops[0], group, comm[0][1])] + [
                Step(_COMBINE[op], op, group, b) for op, b in comm[1:]
            ]
    elif strategy == "allgather_kv":
        head = ["chunk's new K/V"] if pcp > 1 else []
        pieces = len(ops) - len(head)
        if all(op == "all_gather" for op in ops) and (pieces == 0 or dcp > 1):
            names = head + [f"context piece {i + 1}" for i in range(pieces)]
            groups = ["PCP"] * len(head) + ["DCP"] * pieces
            return [Step(w, op, g, b) for w, g, (op, b) in zip(names, groups, comm)]
    else:
        raise RuleError("transfer-strategy", "'allgather_q' or 'allgather_kv'", strategy=strategy)
    raise RuleError(
        "transfer-trace",
        f"a {strategy} trace on pcp={pcp}, dcp={dcp} with the collectives of its strategy",
        ops=ops,
    )


def _lane_y(rank: int, ranks: int) -> float:
    return float(ranks - 1 - rank)  # rank 0 on top


def transfers_figure(
    comm: Mapping[str, Sequence[Sequence[tuple[str, int]]]],
    *,
    pcp: int,
    dcp: int,
    context_len: int,
    chunk_len: int,
    slope: float,
):
    """One panel per strategy in ``comm`` (strategy -> one trace per rank): a lane per rank, a
    column per collective; in each column every rank's block says the bytes it sends to each
    peer (its traced bytes over the ``ranks - 1`` peers; exact for two ranks), with an arrow
    per peer.  The right margin gives each rank's total, the footer the crossover rule
    ``C <= slope · T`` for this request's ``context_len`` and ``chunk_len``."""
    ranks = {len(traces) for traces in comm.values()}
    if len(ranks) != 1 or (dcp not in (1, pcp)) or ranks != {pcp}:
        raise RuleError(
            "transfer-grid",
            "one trace per rank of a tp=1 grid with dcp in (1, pcp) (every collective spans "
            "all pcp ranks)",
            pcp=pcp,
            dcp=dcp,
            traces={st: len(t) for st, t in comm.items()},
        )
    n = pcp
    steps = {
        st: [transfer_steps(st, trace, pcp=pcp, dcp=dcp) for trace in traces]
        for st, traces in comm.items()
    }
    cols = max(len(s[0]) for s in steps.values())
    fig, axes = figure(len(comm), 1, figsize=(_WIDTH, 0.45 + 1.1 * n * len(comm)), squeeze=False)
    totals = {}
    for ax, (st, per_rank) in zip(axes[:, 0], steps.items()):
        for r in range(n):
            y = _lane_y(r, n)
            ax.plot([0, cols], [y, y], color="#BBBBBB", lw=0.8, zorder=0)
            c = rank_color(r)
            ax.add_patch(Rectangle((-0.66, y - 0.2), 0.56, 0.4, facecolor=c, edgecolor="none"))
            ax.text(-0.38, y, f"rank {r}", ha="center", va="center", fontsize=9, color=ink(c))
            sent = sum(s.bytes for s in per_rank[r])
            totals[(st, r)] = sent
            ax.text(cols + 0.08, y, f"{sent:,} B", ha="left", va="center", fontsize=9)
        for j, step in enumerate(per_rank[0]):
            ax.text(
                j + 0.5,
                n - 0.5,
                f"{_OP[step.op]}\nover {step.group}:\n{step.what}",
                ha="center",
                va="bottom",
                fontsize=9,
            )
            for r in range(n):
                s, c = per_rank[r][j], rank_color(r)
                x, y = j + 0.5 + (r - (n - 1) / 2) * (1.0 / n), _lane_y(r, n)
                per_peer = s.bytes // (n - 1)
                ax.add_patch(
                    Rectangle(
                        (x - 0.44 / n, y - 0.17), 0.88 / n, 0.34, facecolor=c, edgecolor="white"
                    )
                )
                ax.text(x, y, f"{per_peer:,} B", ha="center", va="center", fontsize=9, color=ink(c))
                for d in range(n):
                    if d != r:
                        yd = _lane_y(d, n)
                        sign = 1 if yd > y else -1
                        ax.add_patch(
                            FancyArrowPatch(
                                (x, y + sign * 0.17),
                                (x, yd),
                                arrowstyle="-|>",
                                mutation_scale=9,
                                color=c,
                                lw=1.4,
                                gid=f"transfer {st} {j} {r}->{d}",
                            )
                        )
        ax.set_title(
            f"{_TITLES[st]}: {sum(totals[(st, r)] for r in range(n)) // n:,} B sent per rank",
            fontsize=10,
            loc="left",
            pad=40,
        )
        ax.set_xlim(-0.7, cols + 0.72)
        ax.set_ylim(-0.45, n - 0.5)
        ax.axis("off")
    kv_wins = context_len <= slope * chunk_len
    fig.supxlabel(
        f"AllGather-KV sends fewer bytes while C ≤ {slope:.2f} T;\nhere C = {context_len}, "
        f"T = {chunk_len}: {'AllGather-KV' if kv_wins else 'AllGather-Q'} moves less",
        fontsize=9,
    )
    return fig
