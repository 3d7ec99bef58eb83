"""Chapter 9 explorer: the step timeline of a real engine run under a chosen token budget and
KV-cache size, drawn as an HTML grid (one row per request, one cell per engine step).

Every state is a real :class:`cpbook.engine.engine.Engine` run on one inline rank; its readout also
says whether every request's greedy tokens equal the float64 reference's.
"""

from __future__ import annotations

import html
from typing import Sequence

from cpbook.engine.engine import Engine, make_prompts
from cpbook.engine.models import TinyModel, reference_generate
from cpbook.viz.engine import KIND_COLORS, KIND_NAMES, PREEMPT_COLOR, WAIT_COLOR
from cpbook.widgets.explorer import Explorer, explorer, pre

__all__ = ["run_with_arrivals", "timeline_html", "timeline_explorer"]


def run_with_arrivals(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    num_kv_blocks: int,
    max_num_batched_tokens: int,
    first: int = 4,
    late_step: int = 6,
) -> tuple[Engine, list[str], dict[str, int]]:
    """Serve ``prompts`` on one rank: ``prompts[:first]`` arrive at step 1, the rest at step
    ``late_step``; step until all finish.  Returns the engine, the request ids in prompt order
    and each request's arrival step."""
    eng = Engine(
        model,
        cache_config={"num_gpu_blocks": num_kv_blocks},
        scheduler_config={"max_num_batched_tokens": max_num_batched_tokens},
    )
    ids = [eng.add_request(p, max_new_tokens) for p in prompts[:first]]
    arrivals = dict.fromkeys(ids, 1)
    while eng.has_unfinished or len(ids) < len(prompts):
        if len(eng.history) == late_step - 1 and len(ids) < len(prompts):
            late = [eng.add_request(p, max_new_tokens) for p in prompts[first:]]
            arrivals.update(dict.fromkeys(late, late_step))
            ids += late
        eng.step()
    return eng, ids, arrivals


_KIND_CLASS = {"prefill": "p", "chunked_prefill": "c", "decode": "d"}
_STYLE = (
    "<style>.cpt i{display:inline-block;width:12px;height:15px;margin-right:1px;"
    "vertical-align:middle}"
    + "".join(f".cpt i.{c}{{background:{KIND_COLORS[k]}}}" for k, c in _KIND_CLASS.items())
    + f".cpt i.w{{background:{WAIT_COLOR}}}.cpt i.x{{outline:2px solid {PREEMPT_COLOR};"
    "outline-offset:-2px}.cpt b{display:inline-block;width:3.2em;font-weight:400}</style>"
)


def timeline_html(history: Sequence, request_ids: Sequence[str], arrivals: dict[str, int]) -> str:
    """The run as an HTML grid: a cell per (request, step) coloured by the work it got
    (colours of :func:`cpbook.viz.engine.timeline_figure`), waiting light grey, a preemption
    outlined; the grid scrolls sideways inside its box, never widening the page."""
    rows: dict[str, list[str]] = {rid: [] for rid in request_ids}
    done: set[str] = set()
    for rec in history:
        ran = {c[0]: c[1] for c in rec.chunks}
        for rid in request_ids:
            if rid in done or rec.step < arrivals.get(rid, 1):
                rows[rid].append("<i></i>")
                continue
            cls = _KIND_CLASS[ran[rid]] if rid in ran else "w"
            cls += " x" if rid in rec.preempted else ""
            rows[rid].append(f'<i class="{cls}"></i>')
        done |= set(rec.finished)
    lines = "".join(
        f'<div style="white-space:nowrap;line-height:17px"><b>req '
        f"{html.escape(rid)}</b>{''.join(cells)}</div>"
        for rid, cells in rows.items()
    )
    legend = " ".join(f'<i class="{c}"></i> {KIND_NAMES[k]}' for k, c in _KIND_CLASS.items())
    legend += ' <i class="w"></i> waiting <i class="w x"></i> preempted'
    return (
        f'{_STYLE}<div class="cpt" style="overflow-x:auto;font-size:.8em;'
        f'font-family:monospace">{lines}<div style="margin-top:.3em">{legend}</div></div>'
    )


def timeline_explorer(
    model: str = "tiny-mla",
    budgets: Sequence[int] = (8, 16, 24, 32),
    num_kv_blocks: Sequence[int] = (20, 32, 64),
    num_prompts: int = 7,
    max_new_tokens: int = 6,
    seed: int = 0,
    **value,
) -> Explorer:
    """Token budget × KV blocks: every state a real run of the same ``num_prompts`` prompts
    (four at step 1, the rest at step 6), its timeline, and its counts and exactness."""
    prompts = make_prompts(num_prompts, seed=seed)
    weights = TinyModel.from_name(model, seed=0)
    refs = [reference_generate(weights, p, max_new_tokens) for p in prompts]

    def render(budget: int, blocks: int) -> tuple[str, str]:
        eng, ids, arrivals = run_with_arrivals(
            model, prompts, max_new_tokens, num_kv_blocks=blocks, max_num_batched_tokens=budget
        )
        exact = all(list(eng.output(i).tokens) == r for i, r in zip(ids, refs))
        text = (
            f"budget {budget} tokens/step, {blocks} KV blocks: {len(eng.history)} steps, "
            f"{eng.scheduler.num_preemptions} preemption(s),\n"
            f"{eng.prefix_hit_tokens} prefix-hit tokens; tokens == reference: {exact}"
        )
        return timeline_html(eng.history, ids, arrivals), pre(text)

    return explorer(
        render,
        {"budget": list(budgets), "blocks": list(num_kv_blocks)},
        value={"budget": 24, "blocks": 32, **value},
        caption="Move the token budget and the number of KV blocks: each state "
        "is a real run of the engine on one rank.",
    )
