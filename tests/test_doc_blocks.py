"""keel.experiments.doc_blocks: the report marks each table as a block named after its section, `keel paper-report
--docs` rewrites exactly the pages' blocks and says what it did with each, leaves a block the report did not write,
and refuses a block whose end marker is missing; and every block docs/ holds is what the report writes over the
committed records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from keel.errors import ConfigError
from keel.experiments.doc_blocks import begin, blocks, end, mark_tables, write_docs

ROOT = Path(__file__).resolve().parents[1]
RECORDS_CORPUS = {  # the shards the committed records were judged on (Python 3.11.7's standard library)
    "train": {
        "chunk-0-0.bin": "26b32df11715bc36f33a8ebe73662ab9e424b1e7022c312c7074a8aa4a8e37f9",
        "chunk-1-0.bin": "8a743ee6ff14bdc45a54789b27ca50f997ef97ccf8ffc7a4a1612fc4a35b9825",
    },
    "val": {"chunk-0-0.bin": "0dea5c416b58e4b6a3f57f9b72b76b5aca268827c1c9060e91cfc3b5b23c123e"},
}
REPORT = """# Report

## Summary

A note.

| a |
|---|
| {value} |

## Two tables

| b |
|---|
| 2 |

| c |
|---|
| 3 |"""


def test_each_table_of_the_report_is_a_block_named_after_its_section():
    marked = blocks(mark_tables(REPORT.format(value=1)))
    assert list(marked) == ["Summary", "Two tables", "Two tables, table 2"]
    assert marked["Summary"] == "\n".join([begin("Summary"), "| a |", "|---|", "| 1 |", end("Summary")])
    assert marked["Two tables, table 2"].splitlines()[1:-1] == ["| c |", "|---|", "| 3 |"]


def test_write_docs_replaces_the_pages_blocks_and_nothing_else(tmp_path):
    old = blocks(mark_tables(REPORT.format(value=1)))
    page = (
        f"# A page\n\nProse: 0.5.\n\n{old['Summary']}\n\nMore prose.\n\n{begin('not run')}\n| x |\n{end('not run')}\n"
    )
    (tmp_path / "page.md").write_text(page)
    (tmp_path / "plain.md").write_text("no block\n")
    report = mark_tables(REPORT.format(value=2))
    done = write_docs(report, tmp_path)
    assert [(p.name, name, what) for p, name, what in done] == [
        ("page.md", "Summary", "rewritten"),
        ("page.md", "not run", "not in the report"),
    ]
    assert (tmp_path / "page.md").read_text() == page.replace("| 1 |", "| 2 |")
    assert (tmp_path / "plain.md").read_text() == "no block\n"
    assert [what for _, _, what in write_docs(report, tmp_path)][0] == "unchanged"


def test_a_block_without_its_end_marker_is_refused_and_no_page_is_written(tmp_path):
    block = blocks(mark_tables(REPORT.format(value=1)))["Summary"]
    (tmp_path / "a.md").write_text(block + "\n")
    (tmp_path / "b.md").write_text(block.rsplit("\n", 1)[0] + "\n")  # its end marker lost
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="block 'Summary' has no line '<!-- end of keel paper-report: Summary -->'"):
        write_docs(mark_tables(REPORT.format(value=2)), tmp_path)
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before


@pytest.mark.extended
def test_every_block_of_docs_is_what_the_report_writes_over_the_committed_records(tmp_path, monkeypatch):
    """The records are judged against the unigram loss of the `keel data` default corpus (this Python's standard
    library) as the records' machine built it, in 2 shards of training tokens (the loss reads whole blocks of each
    shard, so the layout moves it in the third decimal), rebuilt here; another Python's library gives other tokens,
    and the test says so."""
    from keel.data.preparation import main as data_main
    from keel.experiments.paper import report

    monkeypatch.chdir(tmp_path)
    assert data_main(["data.prepare_workers=2"]) == 0  # data/stdlib, where the records' configs point
    shards = json.loads((tmp_path / "data/stdlib/manifest.json").read_text())["chunk_sha256"]
    if shards != RECORDS_CORPUS:
        pytest.skip(f"this Python's standard library gives other shards ({shards}) than the records' corpus")
    runs, shared = tmp_path / "runs", tmp_path / "shared"  # collecting writes each grid's tables beside its runs
    shutil.copytree(ROOT / "docs/experiments/runs", runs)
    shutil.copytree(ROOT / "docs/experiments/runs-shared-init", shared)
    written = blocks(report(runs, shared))
    held = {
        (page.name, name): block for page in ROOT.glob("docs/*.md") for name, block in blocks(page.read_text()).items()
    }
    assert held, "docs/ quotes no table of the report"
    for (page, name), block in held.items():
        assert name in written, f"docs/{page} holds a block {name!r} the report does not write"
        assert block == written[name], (
            f"docs/{page}'s block {name!r} is not the report's: keel paper-report --docs docs"
        )
