"""cpbook.viz.table: the compact result tables' two renderings agree and reject bad rows."""

import pytest

from cpbook.viz.table import Table, table


def test_text_and_html_show_the_same_cells():
    t = table(
        [
            {"layout": "TP8", "ttft_ms": 1234.5, "fits": True},
            {"layout": "TP4×DCP2", "ttft_ms": 7.25, "fits": False},
        ],
        {"layout": "layout", "ttft_ms": "TTFT (ms)", "fits": "fits"},
        title="Two layouts",
    )
    text = repr(t)
    assert text.splitlines()[0] == "Two layouts"
    assert "1,234.50" in text and "7.25" in text and "yes" in text and "no" in text
    html = t._repr_html_()
    assert html.count("<tr>") == 3 and "TP4×DCP2" in html and "1,234.50" in html
    assert '<th style="text-align: right">TTFT (ms)</th>' in html  # numbers right-aligned
    assert "<th>layout</th>" in html


def test_integers_get_separators_and_none_a_dash():
    t = Table([[1048576, None], [3, 2.0]], ["tokens", "x"], digits=1)
    lines = repr(t).splitlines()
    assert lines[2].split() == ["1,048,576", "—"] and lines[3].split() == ["3", "2.0"]


def test_bad_rows_raise_naming_the_rule():
    with pytest.raises(ValueError, match=r"\[table-row-width\].*row=1, cells=\[3\]"):
        Table([[1, 2], [3]], ["a", "b"])
    with pytest.raises(ValueError, match=r"\[table-missing-key\].*'b'"):
        table([{"a": 1}], ["a", "b"])
