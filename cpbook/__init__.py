"""cpbook: context parallelism for LLM inference, the package behind the executable book.

One concept per module:

* ``config`` — :class:`~cpbook.config.ParallelConfig` (vLLM names) and its rules;
* ``groups`` — the rank grid (TP innermost, PCP outer) and the TP / PCP / DCP groups;
* ``comm`` — the ``Group`` interface: simulated ranks (threads) and torch.distributed, traced;
* ``launch`` — run one per-rank function inline or under ``torchrun``;
* ``attention`` — dense reference, attention with LSE, the exact merge, RoPE (chapter 1);
* ``kvcache``, ``kvmanager`` — DCP's KV layout and slot mapping; the block allocator (ch. 2);
* ``dcp``, ``mla`` — DCP decode for GQA and MLA, and MLA's context path (chapter 3);
* ``zigzag``, ``pcp`` — the DualChunkSwap partition; PCP prefill attention (chapter 4);
* ``dynamic``, ``migration``, ``simulator`` — dynamic CP: the length router, live migration of a
  running request from CP = N to CP = M, the workload simulator of four policies (chapter 7);
* ``models``, ``scheduler``, ``runner``, ``engine`` — tiny GQA/MLA decoders and the mini serving
  engine (continuous batching, paged KV, prefix caching, TP × DCP × PCP), ``serve`` (chapter 9);
* ``costmodel`` — sourced specs, memory, TTFT/TPOT, calibration, ``recommend`` (chapters 1, 6, 8);
* ``timing`` — clocks for ``bench/`` only;
* ``demos`` — the registry of every chapter's per-rank function, behind ``python -m cpbook``;
* ``viz``, ``widgets`` — the chapters' figures and explorers.
"""

__version__ = "0.1.0"
