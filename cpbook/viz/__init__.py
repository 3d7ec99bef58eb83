"""Layer 8, figures for the chapters: one module per concept, one shared style
(:mod:`cpbook.viz.style`).

Every figure is matplotlib, white background, labelled axes, the Okabe–Ito colour-blind-safe
palette, rendered to PNG in notebooks.  Functions return the ``Figure``; chapters call
``plt.show()`` (never a trailing ``;``, which nbval mishandles).  The palette, the text colour
on a fill (``ink``), the number formatters and ``style`` / ``figure`` / ``legible`` live in
:mod:`cpbook.viz.style`; import them from there.
"""
