"""cpbook: context parallelism for LLM inference, the package behind the executable book.

Modules, one concept each: ``config`` (ParallelConfig and its rules), ``groups`` (rank grid),
``comm`` (the Group interface, simulated and torch.distributed backends), ``launch`` (run one
per-rank function inline or under torchrun), ``attention`` (attention with LSE and the exact
merge), ``costmodel`` (hardware, model shapes, KV capacity), ``demos`` (named runnable demos).
"""
__version__ = "0.1.0"
