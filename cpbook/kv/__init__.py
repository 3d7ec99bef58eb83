"""Layer 2, DCP's memory: token ownership and slot mapping (:mod:`.layout`), one rank's paged
store and the sharding of a cache (:mod:`.paged`), the virtual-block manager with prefix caching
(:mod:`.manager`), the P/D block-transfer plan (:mod:`.transfer`) and the context gather that
rebuilds a cached context from DCP shards (:mod:`.gather`)."""
