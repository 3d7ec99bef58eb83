"""The claim ledger (book/claim_ledger.md) against the chapters it links to.

Every ledger row has one verdict (reproduced / corrected / modelled / not reproducible) and names
its kinds of evidence (exact / measured / source / modelled, the last with the parameters that
make it true); a **reproduced** row rests on exact, measured or source evidence, never on the
cost model alone, and a **modelled** row on the cost model.  A row that links to a claim label
``{ref}`Ch. N <claim-slug>``` must find, in chapter N's notebook, a markdown cell that starts
with the MyST label ``(claim-slug)=`` and a code cell tagged ``claim-slug`` whose source contains
an ``assert`` statement.  Every claim label in the notebooks is in the ledger, every claim the
book is committed to (issue 14) has a row, and the page's counts are MyST substitutions computed
by ``book/_ext/cpbook_ledger.py`` when the book builds, which count what this module counts.
Reads files only: no notebook is executed.
"""

import ast
import functools
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "book" / "claim_ledger.md"
NOTEBOOKS = ROOT / "notebooks"
STATUSES = ("reproduced", "corrected", "modelled", "not reproducible")
KINDS = ("exact", "measured", "source", "modelled")

REQUIRED = (
    "8k-4gpu-2k-each",
    "ownership-table-i4-r4",
    "d20-rank1-slots-384-387",
    "d27-rank2",
    "interleave1-fill-25pct",
    "dcp-kvheads-le-tp",
    "tp6-dcp3-2kvheads-shapes",
    "mla-no-q-allgather",
    "step3-all2all",
    "reorg-kvcache-order",
    "dcp-pcp-naming",
    "contiguous-imbalance",
    "pcp3-pairing",
    "pcp2-8token-layout",
    "dcp-group-eq-pcp-group",
    "pcp-ttft-x-ranks",
    "dcp-no-prefill-compute",
    "agq-agkv-crossover",
    "agq-agkv-merge-status",
    "tpa-removes-allgather",
    "tpot-gain-past-128k",
    "break-even-32k-vs-128k",
    "dynamic-tpa-4k",
    "1m-8xh200",
    "1m-8x910c",
    "pcp-between-dp-tp",
    "pcp-best-32k-256k",
    "decision-path",
)

REF = re.compile(r"\{ref\}`Ch\. (\d+) <claim-([a-z0-9-]+)>`")
STATUS = re.compile(r"\*\*(reproduced|corrected|modelled|not reproducible)\*\*")
KIND = re.compile(r"(?<!\*)\*(exact|measured|source|modelled)\*(?!\*)")
MODELLED_WITH_RANGE = re.compile(r"\*modelled\* \([^)]+\)")
LABEL = re.compile(r"^\(claim-([a-z0-9-]+)\)=\s*$", re.M)


def _rows() -> list[str]:
    """Body rows of the ledger's tables (header and separator rows dropped)."""
    rows = []
    for line in LEDGER.read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if line.startswith("| Claim"):
            continue
        rows.append(line)
    return rows


def _cells(row: str) -> list[str]:
    """A row's four cells: claim, verdict and link, evidence kinds, notes."""
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert len(cells) == 4, row
    return cells


def _chapters() -> dict[int, Path]:
    return {int(p.name[:2]): p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}


def _nb_cells(path: Path) -> list[dict]:
    cells = json.loads(path.read_text())["cells"]
    for c in cells:
        if isinstance(c["source"], list):
            c["source"] = "".join(c["source"])
    return cells


def _asserts(source: str) -> bool:
    """True if the cell's code holds an ``assert`` statement (IPython magics removed)."""
    code = "\n".join(
        line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))
    )
    return any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(code)))


def _ledger_refs() -> list[tuple[int, str]]:
    return [(int(ch), slug) for row in _rows() for ch, slug in REF.findall(row)]


@functools.lru_cache(maxsize=None)
def _claims_in(path: Path) -> tuple[set[str], dict[str, list[str]]]:
    """Labels at the top of markdown cells, and tagged code cells' sources, by slug."""
    labels, tagged = set(), {}
    for c in _nb_cells(path):
        if c["cell_type"] == "markdown":
            head = c["source"].lstrip().split("\n\n", 1)[0]
            labels |= set(LABEL.findall(head))
        elif c["cell_type"] == "code":
            for tag in c.get("metadata", {}).get("tags", []):
                if tag.startswith("claim-"):
                    tagged.setdefault(tag[len("claim-") :], []).append(c["source"])
    return labels, tagged


def test_every_row_has_one_status_and_a_source():
    for row in _rows():
        claim, verdict, _, _ = _cells(row)
        assert len(STATUS.findall(verdict)) == 1 and not STATUS.search(claim), row
        assert REF.search(verdict) or "{doc}`" in verdict, row
        if "**corrected**" in row or "**not reproducible**" in row:
            # the evidence: a vLLM file at a tag, a citation, or a chapter's computation
            assert (
                "github.com/vllm-project/vllm/blob/" in row or "{cite}`" in row or REF.search(row)
            ), row


def test_every_row_names_its_kinds_of_evidence():
    for row in _rows():
        _, verdict, evidence, _ = _cells(row)
        kinds = KIND.findall(evidence)
        assert kinds and len(kinds) == len(set(kinds)), row
        if "modelled" in kinds:  # the cost model's parameters that make it true
            assert MODELLED_WITH_RANGE.search(evidence), row
        status = STATUS.search(verdict).group(1)
        if status == "reproduced":  # never on the cost model alone
            assert set(kinds) & {"exact", "measured", "source"}, row
        if status == "modelled":
            assert "modelled" in kinds, row


def test_regraded_claims_say_what_they_rest_on():
    """Issue 22: the entries that rested on the cost model or a design vLLM does not ship;
    issue 19: the decision path, re-graded on the deployment planner."""
    graded = {}
    for row in _rows():
        _, verdict, evidence, _ = _cells(row)
        for _, slug in REF.findall(verdict):
            graded[slug] = (STATUS.search(verdict).group(1), set(KIND.findall(evidence)))
    for slug in (
        "pcp-ttft-x-ranks",
        "pcp-best-32k-256k",
        "pcp-between-dp-tp",
        "tpot-gain-past-128k",
        "1m-8xh200",
        "1m-8x910c",
    ):
        assert graded[slug][0] == "modelled" and "modelled" in graded[slug][1], slug
    assert graded["agq-agkv-merge-status"] == ("corrected", {"source"})
    # issue 19: re-graded on the planner; the path proposes layouts vLLM v0.33 does not run
    # (source) and holds fewer requests than asked (the memory model: modelled)
    assert graded["decision-path"] == ("corrected", {"modelled", "source"})
    assert graded["tpa-removes-allgather"][0] == "reproduced"
    assert {"exact", "source"} <= graded["tpa-removes-allgather"][1]


def test_doc_links_name_existing_chapters():
    for row in _rows():
        for ch, target in re.findall(r"\{doc\}`Ch\. (\d+) <\.\./notebooks/([^>]+)>`", row):
            assert (NOTEBOOKS / f"{target}.ipynb").exists(), row
            assert target.startswith(f"{int(ch):02d}_"), row


def _ledger_extension():
    spec = importlib.util.spec_from_file_location(
        "cpbook_ledger", ROOT / "book" / "_ext" / "cpbook_ledger.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_are_computed_not_typed():
    text = LEDGER.read_text()
    intro = text.split("\n## ", 1)[0]
    names = re.findall(r"\{\{ (ledger_[a-z_]+) \}\}", intro)
    assert set(names) == {
        "ledger_total",
        *(f"ledger_{s.replace(' ', '_')}" for s in STATUSES),
        *(f"ledger_kind_{k}" for k in KINDS),
    }
    sentence = intro[intro.index("Of the {{") :]
    assert not re.search(r"\b\d+\b", sentence.split("\n\n")[0]), "a count is typed"
    # the extension counts what this module counts
    counts = _ledger_extension().ledger_counts(text)
    verdicts = Counter(STATUS.search(_cells(r)[1]).group(1) for r in _rows())
    kinds = Counter(k for r in _rows() for k in set(KIND.findall(_cells(r)[2])))
    assert counts["ledger_total"] == len(_rows())
    assert [counts[f"ledger_{s.replace(' ', '_')}"] for s in STATUSES] == [
        verdicts[s] for s in STATUSES
    ]
    assert [counts[f"ledger_kind_{k}"] for k in KINDS] == [kinds[k] for k in KINDS]
    assert sum(verdicts.values()) == len(_rows())


def test_the_book_builds_with_the_ledger_extension():
    config = (ROOT / "_config.yml").read_text()
    assert "cpbook_ledger: book/_ext" in config and "- substitution" in config


def test_required_claims_have_rows_once():
    slugs = [slug for _, slug in _ledger_refs()]
    assert sorted(set(slugs)) == sorted(slugs), "a claim is listed twice"
    assert not set(REQUIRED) - set(slugs)


@pytest.mark.parametrize("chapter,slug", _ledger_refs(), ids=lambda x: str(x))
def test_linked_section_and_asserting_cell_exist(chapter, slug):
    chapters = _chapters()
    assert chapter in chapters, f"chapter {chapter} has no notebook yet (claim-{slug})"
    labels, tagged = _claims_in(chapters[chapter])
    assert slug in labels, f"no markdown cell of chapter {chapter} starts with (claim-{slug})="
    assert slug in tagged, f"no code cell of chapter {chapter} is tagged claim-{slug}"
    assert any(_asserts(src) for src in tagged[slug]), f"claim-{slug}: no cell asserts"


def test_each_claim_label_is_defined_once():
    # Sphinx resolves a label defined twice to one of the two: the ledger's link could move
    where = Counter(slug for path in _chapters().values() for slug in _claims_in(path)[0])
    assert not [slug for slug, n in where.items() if n > 1]


def test_every_claim_label_in_the_book_is_in_the_ledger():
    listed = {slug for _, slug in _ledger_refs()}
    for path in _chapters().values():
        labels, tagged = _claims_in(path)
        assert labels | set(tagged) <= listed, path.name
