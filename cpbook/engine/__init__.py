"""Layer 5, the mini serving engine: tiny GQA/MLA decoders and their dense reference
(:mod:`.models`), the scheduler (:mod:`.scheduler`), the per-step model runner under
TP × DCP × PCP (:mod:`.runner`), speculative decoding's config, drafters and greedy acceptance
(:mod:`.spec_decode`) and the engine with ``serve_rank`` (:mod:`.engine`)."""
