"""Layer 3, decode context parallelism: GQA decode and its two combines, ``ag_rs`` and ``a2a``
(:mod:`.decode`), MLA's absorbed decode and context path (:mod:`.mla`), TPA / query
replication (:mod:`.tpa`), speculative verification of ``k + 1`` rows per request
(:mod:`.verify`) and the placement of a draft model's KV (:mod:`.draft_placement`)."""
