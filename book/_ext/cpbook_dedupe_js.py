"""Drop repeated inline ``<script>`` bodies from every page.

sphinx-thebe and sphinx-togglebutton register body-only scripts (``add_js_file(None, body=...)``)
once with the builder (filename ``None``) and once more when the builder copies the registry
(filename ``""``); Sphinx 7.4 sees two different assets and writes both.  The second
``const THEBE_JS_URL = ...`` is then a SyntaxError in every page (tests/test_site.py).
"""

from __future__ import annotations

from typing import Any


def _dedupe(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        attrs = getattr(js, "attributes", {})
        key = (getattr(js, "filename", js) or "", tuple(sorted(attrs.items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    context["script_files"] = kept


def setup(app) -> dict[str, Any]:
    app.connect("html-page-context", _dedupe)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
