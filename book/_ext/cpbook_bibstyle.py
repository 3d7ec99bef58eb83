"""Citation styles for cpbook (a Sphinx local extension, see ``_config.yml``).

Two fixes over sphinxcontrib-bibtex's stock ``alpha`` + ``author_year``:

* BibTeX's ``and others`` prints as "et al." (stock: "Zuo and others").
* An entry without author or editor is cited by its ``shorttitle`` if any.
* Same author and year get the bibliography label's suffix, so citations stay
  unambiguous: "(Yang et al., 2025a)" and "(Yang et al., 2025b)" for the
  entries labelled [Y+25a] and [Y+25b]; "n.d.-a" for undated pages.

Registers ``cpbook`` (``bibtex_default_style``) and ``cpbook_author_year``
(``bibtex_reference_style``).
"""

from dataclasses import dataclass, field, fields

import pybtex.plugin
from pybtex.richtext import Tag, Text
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.labels.alpha import LabelStyle as AlphaLabelStyle
from pybtex.style.template import FieldIsMissing, first_of, optional, sentence, tag
from pybtex.style.template import field as bib_field
from sphinxcontrib.bibtex.plugin import register_plugin
from sphinxcontrib.bibtex.style.referencing import PersonStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearParentheticalReferenceStyle as _Parenthetical,
    BasicAuthorYearTextualReferenceStyle as _Textual,
)
from sphinxcontrib.bibtex.style.template import join, join2, node, post_text, pre_text, reference

ET_AL = Text(" ", Tag("em", "et al."))
_LABELS = AlphaLabelStyle()


@node
def names_et_al(children, data, role, format_name, short=False, **kwargs):
    """Names of ``role``; "et al." for a trailing ``others`` (and, if ``short``, for 3+)."""
    assert not children
    try:
        persons = list(data["entry"].persons[role])
    except KeyError:
        raise FieldIsMissing(role, data["entry"])
    others = bool(persons) and str(persons[-1]) == "others"
    formatted = [format_name(data["style"], p) for p in persons[: len(persons) - others]]
    if short and (others or len(formatted) > 2):
        return Text(formatted[0].format_data(data), ET_AL)
    text = join(**kwargs)[formatted].format_data(data)
    return Text(text, ET_AL) if others else text


@node
def year_with_suffix(children, data):
    """The year, plus the a/b/c suffix alpha labelling gave this entry."""
    assert not children
    label, stem = data["formatted_entry"].label, _LABELS.format_label(data["entry"])
    suffix = label[len(stem):] if label.startswith(stem) else ""
    if "year" in data["entry"].fields:
        return Text(data["entry"].fields["year"], suffix)
    return Text("n.d.", "-" + suffix if suffix else "")


class CpbookBibliographyStyle(AlphaStyle):
    """``alpha`` with "et al." for ``others``."""

    def format_names(self, role, as_sentence=True):
        formatted = names_et_al(
            role=role, sep=", ", sep2=" and ", last_sep=", and ",
            format_name=lambda style, p: style.format_name(p, style.abbreviate_names),
        )
        return sentence[formatted] if as_sentence else formatted


@dataclass
class EtAlPersonStyle(PersonStyle):
    """Citation-side names: "et al." for ``others`` or more than two authors."""

    def author_or_editor_or_title(self, full: bool):
        kwargs = dict(
            short=not full, sep=self.sep, sep2=self.sep2, last_sep=self.last_sep,
            format_name=lambda style, p: style.person.style_plugin.format(
                p, style.person.abbreviate
            ),
        )
        return first_of[
            optional[names_et_al(role="author", **kwargs)],
            optional[names_et_al(role="editor", **kwargs)],
            optional[tag("em")[bib_field("shorttitle")]],
            tag("em")[bib_field("title")],
        ]


@dataclass
class _ParentheticalSuffixed(_Parenthetical):
    def inner(self, role_name):
        author = self.person.author_or_editor_or_title(full="s" in role_name)
        return join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text, reference[join(sep=self.author_year_sep)[author, year_with_suffix]], post_text
        ]


@dataclass
class _TextualSuffixed(_Textual):
    def inner(self, role_name):
        author = self.person.author_or_editor_or_title(full="s" in role_name)
        bracketed = join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text, reference[year_with_suffix], post_text
        ]
        return join(sep=self.text_reference_sep)[
            author, join[self.bracket.left, bracketed, self.bracket.right]
        ]


@dataclass
class CpbookAuthorYearStyle(AuthorYearReferenceStyle):
    """``author_year`` with the two fixes of this module."""

    person: PersonStyle = field(default_factory=EtAlPersonStyle)

    def __post_init__(self):
        super().__post_init__()
        swap = {_Parenthetical: _ParentheticalSuffixed, _Textual: _TextualSuffixed}
        for i, style in enumerate(self.styles):
            if type(style) in swap:
                init = {f.name: getattr(style, f.name) for f in fields(style) if f.init}
                self.styles[i] = swap[type(style)](**init)
        self.role_style.update(
            (role, style) for style in self.styles for role in style.role_names()
        )


def setup(app):
    pybtex.plugin.register_plugin("pybtex.style.formatting", "cpbook", CpbookBibliographyStyle)
    register_plugin(
        "sphinxcontrib.bibtex.style.referencing", "cpbook_author_year", CpbookAuthorYearStyle
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
