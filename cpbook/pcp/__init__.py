"""Layer 4, prefill context parallelism: the DualChunkSwap partition, planning only
(:mod:`.zigzag`), PCP prefill attention (:mod:`.prefill`), chunked prefill by AllGather-Q or
AllGather-KV (:mod:`.chunked`) and its planner (:mod:`.chunked_plan`), and ring pass-KV /
pass-Q (:mod:`.ring`) with its planner (:mod:`.ring_plan`)."""
