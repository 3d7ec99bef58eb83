"""Layer 5, the mini serving engine: tiny GQA/MLA decoders and their dense reference
(:mod:`.models`), Hugging Face checkpoints checked and loaded (:mod:`.checkpoint`, :mod:`.hf`,
:mod:`.hf_model`), the configuration objects (:mod:`.config`), the linear layers' weights
prepared once for the device's GEMM (:mod:`.gemm`), the scheduler (:mod:`.scheduler`), the
per-step model runner under TP × DCP × PCP (:mod:`.runner`) and its batched attention backend
(:mod:`.attention`; long steps in blocks, :mod:`.blocks`), speculative decoding's config,
drafters and greedy acceptance (:mod:`.spec_decode`) and the engine with ``serve_rank``
(:mod:`.engine`)."""
