"""Citation styles for cpbook (a Sphinx local extension, see ``_config.yml``).

One label per entry, the same in the prose and in the bibliography: the entry
cited as "(Yang et al., 2025)" is listed as "[Yang et al., 2025]", so a reader
finds it by eye.

* Author part: the entry's ``shorthand`` field if it has one ("vLLM PR #34883",
  for sources one organisation publishes many of); else the last name of a
  single author; two joined by "and"; the first followed by "et al." for three
  or more, or for a list ending in BibTeX's ``and others``. Without author or
  editor: the ``shorttitle`` (else the title).
* Year part: the ``year`` field, or "n.d.". Entries that share both parts get
  a, b, c in bibliography order: "2025a", "n.d.-a".
* The bibliography is sorted by author part, then year, then title.

Registers the label and sorting styles ``cpbook_author_year``, the formatting
style ``cpbook`` (``bibtex_default_style``) and the referencing style
``cpbook_author_year`` (``bibtex_reference_style``).
"""

from collections import Counter
from dataclasses import dataclass, field, fields

import pybtex.plugin
from pybtex.richtext import Tag, Text
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import FieldIsMissing, first_of, optional, sentence, tag
from pybtex.style.template import field as bib_field
from sphinxcontrib.bibtex.plugin import register_plugin
from sphinxcontrib.bibtex.style.referencing import PersonStyle
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearParentheticalReferenceStyle as _Parenthetical,
)
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearTextualReferenceStyle as _Textual,
)
from sphinxcontrib.bibtex.style.template import join, join2, node, post_text, pre_text, reference

ET_AL = Text(" ", Tag("em", "et al."))
_ET_AL_TEXT = " et al."
_LAST_NAMES = pybtex.plugin.find_plugin("pybtex.style.names", "last")()


def _persons(entry) -> list:
    for role in ("author", "editor"):
        if entry.persons.get(role):
            return list(entry.persons[role])
    return []


def author_part(entry) -> str:
    """The author text of an entry's label (plain text, see the module docstring)."""
    if "shorthand" in entry.fields:
        return Text.from_latex(entry.fields["shorthand"]).render_as("text")
    persons = _persons(entry)
    if not persons:
        name = "shorttitle" if "shorttitle" in entry.fields else "title"
        return Text.from_latex(entry.fields[name]).render_as("text")
    others = str(persons[-1]) == "others"
    names = [
        _LAST_NAMES.format(p, True).format().render_as("text")
        for p in persons[: len(persons) - others]
    ]
    if others or len(names) > 2:
        return names[0] + _ET_AL_TEXT
    return " and ".join(names)


class AuthorYearLabelStyle(BaseLabelStyle):
    """Labels "Author, Year", with a, b, c for entries that share both parts."""

    def format_labels(self, sorted_entries):
        keys = [(author_part(e), e.fields.get("year", "n.d.")) for e in sorted_entries]
        count, seen = Counter(keys), Counter()
        for author, year in keys:
            suffix = ""
            if count[author, year] > 1:
                suffix = ("-" if year == "n.d." else "") + chr(ord("a") + seen[author, year])
                seen[author, year] += 1
            yield f"{author}, {year}{suffix}"


class AuthorYearSortingStyle(BaseSortingStyle):
    """Sorts by the label's author part, then year, then title."""

    def sorting_key(self, entry):
        return (
            author_part(entry).lower(),
            entry.fields.get("year", ""),
            entry.fields.get("title", "").lower(),
        )


def _label_parts(data) -> tuple[str, str]:
    author, _, year = data["formatted_entry"].label.rpartition(", ")
    return author, year


@node
def label_author(children, data):
    """The author part of the entry's label, "et al." in italics, a title in italics."""
    assert not children
    author, _ = _label_parts(data)
    if "shorthand" in data["entry"].fields:
        return Text(author)
    if not _persons(data["entry"]):
        return Tag("em", author)
    if author.endswith(_ET_AL_TEXT):
        return Text(author[: -len(_ET_AL_TEXT)], ET_AL)
    return Text(author)


@node
def label_year(children, data):
    """The year part of the entry's label ("2025a", "n.d.")."""
    assert not children
    return Text(_label_parts(data)[1])


@node
def names_et_al(children, data, role, format_name, **kwargs):
    """All names of ``role``, with "et al." for a trailing ``others``."""
    assert not children
    try:
        persons = list(data["entry"].persons[role])
    except KeyError:
        raise FieldIsMissing(role, data["entry"])
    others = bool(persons) and str(persons[-1]) == "others"
    formatted = [format_name(data["style"], p) for p in persons[: len(persons) - others]]
    text = join(**kwargs)[formatted].format_data(data)
    return Text(text, ET_AL) if others else text


class CpbookBibliographyStyle(AlphaStyle):
    """``alpha`` entries with "et al." for ``others``, author-year labels and order."""

    default_label_style = "cpbook_author_year"
    default_sorting_style = "cpbook_author_year"

    def format_names(self, role, as_sentence=True):
        formatted = names_et_al(
            role=role,
            sep=", ",
            sep2=" and ",
            last_sep=", and ",
            format_name=lambda style, p: style.format_name(p, style.abbreviate_names),
        )
        return sentence[formatted] if as_sentence else formatted


@dataclass
class FullNamesPersonStyle(PersonStyle):
    """Names for ``{cite:ps}`` and ``{cite:ts}``: every author, "et al." for ``others``."""

    def author_or_editor_or_title(self, full: bool):
        kwargs = dict(
            sep=self.sep,
            sep2=self.sep2,
            last_sep=self.last_sep,
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


def _author(style, role_name: str):
    """Every author for the ``s`` roles, else the label's author part."""
    return style.person.author_or_editor_or_title(full=True) if "s" in role_name else label_author


@dataclass
class _ParentheticalLabelled(_Parenthetical):
    def inner(self, role_name):
        return join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text,
            reference[join(sep=self.author_year_sep)[_author(self, role_name), label_year]],
            post_text,
        ]


@dataclass
class _TextualLabelled(_Textual):
    def inner(self, role_name):
        bracketed = join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text, reference[label_year], post_text
        ]
        return join(sep=self.text_reference_sep)[
            _author(self, role_name), join[self.bracket.left, bracketed, self.bracket.right]
        ]


@dataclass
class CpbookAuthorYearStyle(AuthorYearReferenceStyle):
    """``author_year`` citations whose author and year are the entry's label."""

    person: PersonStyle = field(default_factory=FullNamesPersonStyle)

    def __post_init__(self):
        super().__post_init__()
        swap = {_Parenthetical: _ParentheticalLabelled, _Textual: _TextualLabelled}
        for i, style in enumerate(self.styles):
            if type(style) in swap:
                init = {f.name: getattr(style, f.name) for f in fields(style) if f.init}
                self.styles[i] = swap[type(style)](**init)
        self.role_style.update(
            (role, style) for style in self.styles for role in style.role_names()
        )


def setup(app):
    pybtex.plugin.register_plugin("pybtex.style.labels", "cpbook_author_year", AuthorYearLabelStyle)
    pybtex.plugin.register_plugin(
        "pybtex.style.sorting", "cpbook_author_year", AuthorYearSortingStyle
    )
    pybtex.plugin.register_plugin("pybtex.style.formatting", "cpbook", CpbookBibliographyStyle)
    register_plugin(
        "sphinxcontrib.bibtex.style.referencing", "cpbook_author_year", CpbookAuthorYearStyle
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
