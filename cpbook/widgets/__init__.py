"""Layer 9, explorers for the chapters, one module per concept, all built on :mod:`.explorer`.

An explorer precomputes its states, so it responds to its controls in the static book (no
kernel, no network) and runs live with ipywidgets in Jupyter.  Each chapter keeps a captioned
static figure beside its explorer.
"""
