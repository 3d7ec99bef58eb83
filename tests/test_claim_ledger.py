"""The claim ledger (book/claim_ledger.md) against the chapters it links to.

Every ledger row has one status (reproduced / corrected / not reproducible).  A row that links
to a claim label ``{ref}`Ch. N <claim-slug>``` must find, in chapter N's notebook, a markdown
cell that starts with the MyST label ``(claim-slug)=`` and a code cell tagged ``claim-slug``
whose source contains an ``assert`` statement.  Every claim label in the notebooks is in the
ledger, every claim the book is committed to (issue 14) has a row, and the counts the page
states are the counts of its rows.  Reads files only: no notebook is executed.
"""

import ast
import functools
import json
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "book" / "claim_ledger.md"
NOTEBOOKS = ROOT / "notebooks"
STATUSES = ("reproduced", "corrected", "not reproducible")

# The article's checkable claims the ledger must cover (issue 14); the names are fixed.
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
STATUS = re.compile(r"\*\*(reproduced|corrected|not reproducible)\*\*")
LABEL = re.compile(r"^\(claim-([a-z0-9-]+)\)=\s*$", re.M)
COUNTS = re.compile(
    r"Of the (\d+) claims below, (\d+) are \*\*reproduced\*\*, (\d+) "
    r"\*\*corrected\*\* and (\d+) \*\*not reproducible\*\*"
)


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


def _chapters() -> dict[int, Path]:
    return {int(p.name[:2]): p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}


def _cells(path: Path) -> list[dict]:
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
    for c in _cells(path):
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
        assert len(STATUS.findall(row)) == 1, row
        assert REF.search(row) or "{doc}`" in row, row
        if "**corrected**" in row or "**not reproducible**" in row:
            # the evidence: a vLLM file at a tag, a citation, or a chapter's computation
            assert (
                "github.com/vllm-project/vllm/blob/" in row or "{cite}`" in row or REF.search(row)
            ), row


def test_doc_links_name_existing_chapters():
    for row in _rows():
        for ch, target in re.findall(r"\{doc\}`Ch\. (\d+) <\.\./notebooks/([^>]+)>`", row):
            assert (NOTEBOOKS / f"{target}.ipynb").exists(), row
            assert target.startswith(f"{int(ch):02d}_"), row


def test_stated_counts_match_the_rows():
    m = COUNTS.search(LEDGER.read_text())
    assert m, "the ledger states its counts"
    total, *by_status = map(int, m.groups())
    found = Counter(STATUS.search(row).group(1) for row in _rows())
    assert total == len(_rows())
    assert by_status == [found[s] for s in STATUSES]


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
