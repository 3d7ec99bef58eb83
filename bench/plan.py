"""The deployment planner on a grid of questions: how fast, and whether it equals brute force.

    python bench/plan.py --json              # 336 questions: summary line
    python bench/plan.py --json --rows       # plus one line per question

Asks :func:`cpbook.planner.plan.plan` (with its reasons and, where nothing fits, its
what-would-fit search) every question of the grid: the 7 built-in models x prompts 4K, 32K,
128K, 1M x concurrency 1, 16, 128, 512 x 4, 8, 16 H200, 1K output tokens, the default
objective (``--objective``: latency up to the concurrency where decode throughput saturates,
throughput per GPU above it).  Each answer's ranking is compared with
:func:`cpbook.planner.plan_space.brute_force` (every size in 1..N, no pruning, no cache) for
the same objective.  Prints a ``{"name": "plan_bench_run", "date_utc": ...}``
line, then (``--rows``) ``{"name": "plan_question", "model": ..., "ms": ..., "objective": ...,
"winner": ..., "agrees": ...}`` lines, then::

    {"name": "plan_bench", "questions": ..., "median_ms": ..., "p99_ms": ..., "first_ms": ...,
     "no_fit": ..., "median_ms_fit": ..., "median_ms_no_fit": ...,
     "agree_with_brute_force": ...}

``first_ms`` is the first question (cold caches); ``no_fit`` questions have no winner and
run the what-would-fit search.  Targets: median <= 50 ms per question,
agreement 1.0 (100 %).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

from cpbook.costmodel.specs import MODELS
from cpbook.planner.objective import AUTO, OBJECTIVES
from cpbook.planner.plan import plan
from cpbook.planner.plan_space import brute_force
from cpbook.planner.search_space import ServingWorkload
from cpbook.timing import machine_record, stopwatch

K = 1024
PROMPTS = (4 * K, 32 * K, 128 * K, 1024 * K)
CONCURRENCY = (1, 16, 128, 512)
GPU_COUNTS = (4, 8, 16)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print JSON lines (the default output)")
    p.add_argument("--rows", action="store_true", help="one line per question")
    p.add_argument("--gpu", default="H200")
    p.add_argument("--objective", default=AUTO, choices=(AUTO, *OBJECTIVES))
    a = p.parse_args(argv)
    print(json.dumps({"name": "plan_bench_run", **machine_record()}))
    times, agree, fit_ms, no_fit_ms = [], 0, [], []
    grid = list(itertools.product(sorted(MODELS), PROMPTS, CONCURRENCY, GPU_COUNTS))
    for model, prompt, conc, n in grid:
        w = ServingWorkload(prompt, K, conc)
        with stopwatch() as t:
            answer = plan(model, a.gpu, n, w, objective=a.objective)
        ms = t.ms
        same = list(answer.ranked) == brute_force(MODELS[model], answer.gpu, n, w, a.objective)
        times.append(ms)
        agree += same
        (fit_ms if answer.winner else no_fit_ms).append(ms)
        if a.rows:
            row = {"name": "plan_question", "model": model, "prompt_tokens": prompt}
            row |= {"concurrency": conc, "num_gpus": n, "ms": round(ms, 2)}
            row |= {"objective": answer.objective}
            row |= {"winner": answer.winner.label if answer.winner else None, "agrees": same}
            print(json.dumps(row))
    ordered = sorted(times)
    summary = {
        "name": "plan_bench",
        "objective": a.objective,
        "questions": len(grid),
        "median_ms": round(statistics.median(times), 2),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "first_ms": round(times[0], 2),
        "no_fit": len(no_fit_ms),
        "median_ms_fit": round(statistics.median(fit_ms), 2),
        "median_ms_no_fit": round(statistics.median(no_fit_ms), 2),
        "agree_with_brute_force": agree / len(grid),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
