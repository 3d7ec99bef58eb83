"""Layer 1, what every mechanism stands on: the traced ``Group`` interface and its backends
(:mod:`.comm`, :mod:`.backends`, :mod:`.context`), the launcher (:mod:`.launch`), the validated
:class:`~cpbook.core.config.ParallelConfig` (:mod:`.config`) and its head-placement rules
(:mod:`.heads`), the rank grid (:mod:`.groups`), dense attention with the LSE merge
(:mod:`.attention`), the one ``config.json`` reader (:mod:`.hf_config`, no torch), and
:class:`~cpbook.core.errors.RuleError`, the one error every rule raises
(:mod:`.errors`)."""
