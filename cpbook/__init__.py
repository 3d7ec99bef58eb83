"""cpbook: context parallelism for LLM inference, the package behind the executable book.

The sub-packages are its layers, lowest first.  A module imports only from its own sub-package
and from rows above its own, at module top (``tests/test_layers.py`` reads this table and checks
every import):

1. ``core`` — the traced ``Group`` interface, its simulated and torch.distributed backends, the
   launcher, :class:`~cpbook.core.config.ParallelConfig` and every rule (one ``RuleError``),
   head placement, the rank grid, dense attention with the LSE merge, the dense float64
   references and problem generators the tests use as their oracle, the one ``config.json``
   reader.
2. ``data``, ``kv`` — the stored CPU runs the package reads (package data); DCP's memory:
   ownership and slot mapping, the paged store, the virtual-block manager with prefix caching,
   the P/D transfer plan, the context gather (chapter 2).
3. ``dcp`` — DCP decode for GQA and MLA, MLA's context path, TPA (chapters 3, 6).
4. ``pcp`` — the DualChunkSwap partition, PCP prefill, chunked prefill AllGather-Q /
   AllGather-KV (which combines over the DCP group, hence below ``dcp``), ring pass-KV /
   pass-Q, and their planners (chapters 4, 5).
5. ``costmodel``, ``engine`` — sourced specs, memory, TTFT/TPOT, speculative decoding's
   break-even, calibration (chapters 1, 6, 8); tiny models, scheduler, runner, engine
   (chapter 9).
6. ``dynamic``, ``planner`` — the length router, live migration, the workload simulator
   (chapter 7); model shapes from ``config.json``, vLLM v0.34's deployment rules, the
   deployment planner ``plan`` and the article's decision path as a check on it (chapters 0, 8).
7. ``demos`` — one module per chapter: its ``*_rank`` functions (checked against
   ``core.reference``), and the registry behind ``python -m cpbook demo``.
8. ``viz`` — the chapters' figures, and the one style module (palette, ink, formatters).
9. ``widgets`` — the explorers (live ipywidgets, and static HTML for the book).
10. ``timing``, ``tools`` — the one place that reads a clock (for ``bench/``); the notebook
    executor and the one-GPU smoke run.
11. ``cli`` — the command line, one module per sub-command (``demo``, ``serve``, ``plan``).
12. ``__main__`` — ``python -m cpbook`` and the ``cpbook`` console script: ``cli.main``.
"""

__version__ = "0.1.0"
