"""Repository, issue and launch buttons only when the book names a real repository.

One setting: ``repository.url`` in ``_config.yml`` (empty by default).  Set to a repository
URL, it turns on the repository and issue buttons and the Binder and Colab launch buttons for
the notebooks; left empty, none of them is drawn, so no button points at a repository that does
not exist.  The download button (the page's source, ``.ipynb`` or ``.md``) is always there.
"""

from __future__ import annotations

from typing import Any

#: the launch services a notebook page links to when the repository is set
LAUNCH = {"binderhub_url": "https://mybinder.org", "colab_url": "https://colab.research.google.com"}
#: Jupyter Book 1's placeholder URL when ``repository.url`` is missing
PLACEHOLDER = "https://github.com/executablebooks/jupyter-book"


def repository_url(theme_options: dict) -> str:
    """The configured repository URL, or ``""`` when none (or only Jupyter Book's default)."""
    url = (theme_options.get("repository_url") or "").strip()
    return "" if url == PLACEHOLDER else url


def _buttons(app, config) -> None:
    opts = dict(config.html_theme_options or {})
    url = repository_url(opts)
    if url and not url.startswith(("https://", "http://")):
        raise ValueError(f"[repository-url] requires an http(s) URL or nothing; got {url!r}")
    on = bool(url)
    opts.update(use_repository_button=on, use_issues_button=on, use_download_button=True)
    launch = dict(opts.get("launch_buttons") or {})
    for key, value in LAUNCH.items():
        launch[key] = value if on else ""
    opts["launch_buttons"] = launch
    if not on:
        opts.pop("repository_url", None)
    config.html_theme_options = opts


def setup(app) -> dict[str, Any]:
    app.connect("config-inited", _buttons)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
