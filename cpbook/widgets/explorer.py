"""Explorers that work in the static book and live in Jupyter.

An explorer shows what ``render(**values)`` returns for the values its controls select.  It
precomputes every state of a small grid (the product of the controls' values) when it is
built, so the same object can be shown two ways:

* **static HTML** (``text/html``): the controls are plain ``<select>`` / ``<input type=range>``
  elements and every distinct state is a hidden panel; about twenty lines of self-contained
  JavaScript in the output show the panel the controls select.  No kernel, no network, no CDN:
  figures are PNGs inlined as ``data:`` URIs.  Before the script runs (or without JavaScript)
  the controls show their defaults and the default panel is the visible one, so a control never
  contradicts its readout.  ``_config.yml`` makes the book prefer this HTML;
* **live** (ipywidgets, ``application/vnd.jupyter.widget-view+json``, or ``.widget()``): in
  Jupyter the same controls as widgets driven by the kernel; a change shows the state of the
  new values.  Jupyter prefers this view when its widget manager is present.

Usage (a notebook cell whose last expression is the explorer; the chapter keeps its static
figure as a separate, captioned cell)::

    from cpbook.widgets.explorer import Control, explorer, pre

    def render(dcp: int, tokens: int):
        fig = ...                                   # a matplotlib Figure
        return fig, pre(f"{tokens:,} tokens: ...")  # or a Figure, or an HTML string

    explorer(render, {"dcp": [1, 2, 4, 8], "tokens": Control([2**13, 2**17], names=["8K", "128K"])},
             value={"dcp": 8}, alt="Bars of per-GPU KV at DCP {dcp}, {tokens} tokens",
             caption="Move DCP and the context length.")

``render`` returns a matplotlib ``Figure`` (saved as a palette PNG at ``dpi`` and closed), a
string of HTML, or a tuple/list of these.  ``alt`` (a ``str.format`` template over the control
values, or a callable) is required when a state holds a figure.  Keep the grid small: the page
carries every distinct state (``Explorer.nbytes`` says how much; aim for well under 1 MB).
HTML readouts are far lighter than PNGs: chapters 1-3 draw bars and grids as HTML
(``cpbook.widgets.memory``, ``.kvcache``, ``.dcp``: 31, 71 and 69 KB for 96, 10 and 48 states).

Strict nbval compares the stored ``text/html`` with a fresh run.  PNG bytes are not lessons
(nbval skips ``image/png`` everywhere), so ``conftest.py`` replaces the payload of the images
this module writes, and only those (``NBVAL_PNG_PATTERN``), before comparing; the controls,
the state map and every text readout are still compared.  Identical inputs give identical HTML
(ids are hashes of the content without the image bytes).
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import itertools
import json
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from cpbook.core.errors import RuleError

__all__ = ["Control", "Explorer", "explorer", "pre", "NBVAL_PNG_PATTERN", "NBVAL_PNG_REPLACE"]

# The images this module writes, for nbval's sanitizer: ``<img class="cpx-img" ... src="...">``.
NBVAL_PNG_PATTERN = r'(<img class="cpx-img" src="data:image/png;base64,)[A-Za-z0-9+/=]+'
NBVAL_PNG_REPLACE = r"\1PNG"


@dataclass(frozen=True)
class Control:
    """One control: the values it offers, their display names, and how it is drawn.

    ``kind`` is ``"slider"`` or ``"select"``; by default numbers get a slider, anything else a
    drop-down.  ``label`` defaults to the control's key in ``controls``.
    """

    values: Sequence[Any]
    names: Sequence[str] | None = None
    kind: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if not len(self.values):
            raise RuleError("explorer-control", "at least one value", values=self.values)
        if self.names is not None and len(self.names) != len(self.values):
            raise RuleError(
                "explorer-control",
                "one name per value",
                names=len(self.names),
                values=len(self.values),
            )
        if self.kind not in (None, "slider", "select"):
            raise RuleError("explorer-control", "kind slider or select", kind=self.kind)

    @property
    def display(self) -> list[str]:
        return [str(n) for n in (self.names or [str(v) for v in self.values])]

    @property
    def widget_kind(self) -> str:
        numeric = all(
            isinstance(v, numbers.Number) and not isinstance(v, bool) for v in self.values
        )
        return self.kind or ("slider" if numeric and len(self.values) > 2 else "select")


def pre(text: str) -> str:
    """A plain-text readout as HTML (escaped, monospaced, scrolls inside itself if too wide)."""
    return f'<pre class="cpx-pre">{html.escape(text)}</pre>'


def _png(fig: Any, dpi: int) -> bytes:
    """``fig`` as a small PNG (256-colour palette, no timestamp), and close it."""
    import matplotlib.pyplot as plt
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=256)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
    return out.getvalue()


def _is_figure(obj: Any) -> bool:
    return hasattr(obj, "savefig") and hasattr(obj, "axes")


_STYLE = (
    "<style>.cpx{border:1px solid #d0d7de;border-radius:6px;padding:.6em .8em;margin:.8em 0;"
    "max-width:100%;box-sizing:border-box}"
    ".cpx-controls{display:flex;flex-wrap:wrap;gap:.4em 1.4em;margin-bottom:.5em}"
    ".cpx-controls label{display:flex;align-items:center;gap:.4em;font-size:.9em}"
    ".cpx-controls input[type=range]{width:9em;max-width:40vw}"
    ".cpx-controls output{min-width:3.5em;font-family:monospace}"
    ".cpx-img{max-width:100%;height:auto;display:block}"
    ".cpx-pre{overflow-x:auto;max-width:100%;font-size:.85em;margin:.3em 0}"
    ".cpx-caption{font-size:.85em;color:#57606a;margin:.4em 0 0}</style>"
)

# Shows the panel the controls select.  Self-contained: no library, no network.
_SCRIPT = """<script>(function(){
var s=document.currentScript,root=s?s.parentNode:document.getElementById("%s");
if(!root||root.getAttribute("data-cpx-ready"))return;root.setAttribute("data-cpx-ready","1");
var map=JSON.parse(root.getAttribute("data-cpx-map"));
var ctrls=root.querySelectorAll("[data-cpx-control]"),panels=root.querySelectorAll(".cpx-panel");
function show(){var key=[];
for(var i=0;i<ctrls.length;i++){var c=ctrls[i];key.push(c.value);
var o=c.parentNode.querySelector("output");
if(o)o.textContent=JSON.parse(c.getAttribute("data-cpx-names"))[+c.value];}
var k=map[key.join(".")];
for(var j=0;j<panels.length;j++)panels[j].hidden=(j!==k);
root.setAttribute("data-cpx-state",key.join("."));}
for(var i=0;i<ctrls.length;i++){ctrls[i].addEventListener("input",show);
ctrls[i].addEventListener("change",show);}
show();})();</script>"""


class Explorer:
    """A grid of precomputed states over ``controls``; see the module docstring.

    ``states`` maps each index tuple of the grid to the index of its panel in ``panels`` (equal
    outputs share one panel).  ``value`` gives the initial value of some controls (default:
    each control's first value).
    """

    def __init__(
        self,
        render: Callable[..., Any],
        controls: Mapping[str, Sequence[Any] | Control],
        *,
        value: Mapping[str, Any] | None = None,
        alt: str | Callable[..., str] | None = None,
        caption: str | None = None,
        dpi: int = 80,
    ) -> None:
        self.render, self.alt, self.caption, self.dpi = render, alt, caption, dpi
        self.controls = {
            k: c if isinstance(c, Control) else Control(list(c)) for k, c in controls.items()
        }
        value = dict(value or {})
        unknown = set(value) - set(self.controls)
        if unknown:
            raise RuleError("explorer-value", "known controls", unknown=sorted(unknown))
        for k, v in value.items():
            if v not in list(self.controls[k].values):
                raise RuleError("explorer-value", f"one of {k}'s values", **{k: v})
        self.index = {
            k: list(c.values).index(value.get(k, c.values[0])) for k, c in self.controls.items()
        }
        self._parts: dict[tuple[int, ...], list[tuple[str, Any]]] = {}
        self.panels: list[list[tuple[str, Any]]] = []
        self.states: dict[tuple[int, ...], int] = {}
        seen: dict[str, int] = {}
        for idx in itertools.product(*(range(len(c.values)) for c in self.controls.values())):
            parts = self._render(self._values(idx))
            sig = hashlib.sha1(repr(parts).encode()).hexdigest()
            if sig not in seen:
                seen[sig] = len(self.panels)
                self.panels.append(parts)
            self.states[idx] = seen[sig]
            self._parts[idx] = parts
        self._html = self._build_html()

    def _values(self, idx: Sequence[int]) -> dict[str, Any]:
        return {k: c.values[i] for (k, c), i in zip(self.controls.items(), idx)}

    def _alt(self, values: Mapping[str, Any]) -> str:
        if callable(self.alt):
            return self.alt(**values)
        names = {k: c.display[list(c.values).index(values[k])] for k, c in self.controls.items()}
        return self.alt.format(**names)

    def _render(self, values: Mapping[str, Any]) -> list[tuple[str, Any]]:
        out = self.render(**values)
        items = out if isinstance(out, (list, tuple)) else [out]
        parts: list[tuple[str, Any]] = []
        if self.alt is None and any(_is_figure(item) for item in items):
            import matplotlib.pyplot as plt

            for item in items:
                if _is_figure(item):
                    plt.close(item)
            raise RuleError("explorer-alt", "alt text for a state with a figure", values=values)
        for item in items:
            if _is_figure(item):
                parts.append(("png", (_png(item, self.dpi), self._alt(values))))
            elif isinstance(item, str):
                parts.append(("html", item))
            else:
                raise TypeError(f"render returned {type(item).__name__}: not a Figure or str")
        return parts

    # ---- static HTML -------------------------------------------------------------------
    @staticmethod
    def _panel_html(parts: list[tuple[str, Any]], images: bool = True) -> str:
        out = []
        for kind, item in parts:
            if kind == "png":
                png, alt = item
                data = base64.b64encode(png).decode() if images else ""
                out.append(
                    f'<img class="cpx-img" src="data:image/png;base64,{data}" '
                    f'alt="{html.escape(alt)}">'
                )
            else:
                out.append(item)
        return "".join(out)

    def _controls_html(self) -> str:
        out = []
        for key, c in self.controls.items():
            i, names = self.index[key], c.display
            attrs = (
                f'data-cpx-control="{html.escape(key)}" autocomplete="off" '
                f"data-cpx-names='{html.escape(json.dumps(names), quote=True)}'"
            )
            label = html.escape(c.label or key)
            if c.widget_kind == "slider":
                field = (
                    f'<input type="range" min="0" max="{len(names) - 1}" step="1" value="{i}" '
                    f'aria-label="{label}" {attrs}><output>{html.escape(names[i])}</output>'
                )
            else:
                opts = "".join(
                    f'<option value="{j}"{" selected" if j == i else ""}>{html.escape(n)}</option>'
                    for j, n in enumerate(names)
                )
                field = f"<select {attrs}>{opts}</select>"
            out.append(f"<label>{label} {field}</label>")
        return '<div class="cpx-controls">' + "".join(out) + "</div>"

    def _core_html(self, images: bool) -> str:
        default = self.states[tuple(self.index.values())]
        body = "".join(
            f'<div class="cpx-panel" aria-live="polite"{"" if p == default else " hidden"}>'
            f"{self._panel_html(parts, images)}</div>"
            for p, parts in enumerate(self.panels)
        )
        caption = f'<p class="cpx-caption">{self.caption}</p>' if self.caption else ""
        return self._controls_html() + body + caption

    def _build_html(self) -> str:
        smap = {".".join(map(str, idx)): p for idx, p in self.states.items()}
        # the id hashes everything but the image bytes, so nbval sees the same id every run
        uid = "cpx-" + hashlib.sha1(self._core_html(images=False).encode()).hexdigest()[:10]
        return (
            f'<div class="cpx" id="{uid}" data-cpx-map=\'{json.dumps(smap)}\'>'
            f"{_STYLE}{self._core_html(images=True)}{_SCRIPT % uid}</div>"
        )

    def to_html(self) -> str:
        """The self-contained static explorer (deterministic for deterministic ``render``)."""
        return self._html

    @property
    def nbytes(self) -> int:
        """Bytes the static explorer adds to a page."""
        return len(self._html.encode())

    # ---- live ipywidgets ---------------------------------------------------------------
    def widget(self):
        """The live view: ipywidgets controls over the same values; ``render`` runs on demand."""
        import ipywidgets as w

        ctrls = {}
        for key, c in self.controls.items():
            opts = list(zip(c.display, range(len(c.values))))
            cls = w.SelectionSlider if c.widget_kind == "slider" else w.Dropdown
            ctrls[key] = cls(options=opts, value=self.index[key], description=c.label or key)
        box = w.VBox()

        def children(idx: tuple[int, ...]) -> list:
            parts = self._parts.get(idx) or self._render(self._values(idx))
            return [
                w.Image(value=item[0], format="png", layout=w.Layout(max_width="100%"))
                if kind == "png"
                else w.HTML(item)
                for kind, item in parts
            ]

        def update(_=None) -> None:
            box.children = children(tuple(c.value for c in ctrls.values()))

        for c in ctrls.values():
            c.observe(update, names="value")
        update()
        return w.VBox([w.HBox(list(ctrls.values()), layout=w.Layout(flex_flow="row wrap")), box])

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        bundle: dict[str, Any] = {"text/plain": repr(self), "text/html": self._html}
        try:
            view = self.widget()._repr_mimebundle_()
        except ImportError:  # no ipywidgets: the static HTML alone
            return bundle
        if view and "application/vnd.jupyter.widget-view+json" in view:
            key = "application/vnd.jupyter.widget-view+json"
            bundle[key] = view[key]
        return bundle

    def __repr__(self) -> str:
        names = ", ".join(f"{k}[{len(c.values)}]" for k, c in self.controls.items())
        return f"Explorer({names}: {len(self.states)} states, {len(self.panels)} panels)"


def explorer(
    render: Callable[..., Any],
    controls: Mapping[str, Sequence[Any] | Control],
    **kwargs: Any,
) -> Explorer:
    """Build an :class:`Explorer` (precomputes every state); display it as a cell's result."""
    return Explorer(render, controls, **kwargs)
