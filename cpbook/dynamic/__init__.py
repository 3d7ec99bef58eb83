"""Layer 6, dynamic CP: the length router (:mod:`.router`), live migration of a running
request's KV from CP = N to CP = M (:mod:`.migration`) and the workload simulator of four
serving policies (:mod:`.simulator`)."""
