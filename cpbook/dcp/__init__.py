"""Layer 3, decode context parallelism: GQA decode and its two combines, ``ag_rs`` and ``a2a``
(:mod:`.decode`), MLA's absorbed decode and context path (:mod:`.mla`), and TPA / query
replication (:mod:`.tpa`)."""
