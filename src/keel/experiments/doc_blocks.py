"""The tables of docs/ that `keel paper-report` writes. The report marks each of its tables as a block named after
its section (`## TITLE`, less what follows a ';' in its closing parenthesis; the section's second table is `TITLE,
table 2`, and so on) between `<!-- keel paper-report: NAME -->` and `<!-- end of keel paper-report: NAME -->`. A
page of docs/ quotes a table by holding the same block, and `keel paper-report DIR --docs docs` rewrites the pages'
blocks with the report's, so no figure in them is typed by hand. The tests hold the committed pages to the report
over the committed records."""

from __future__ import annotations

import os
import re
from pathlib import Path

from keel.errors import ConfigError

# markers are whole lines: a page may quote one inside a sentence
_OPEN = r"^<!-- keel paper-report: (?P<name>[^>\n]+?) -->$"
_BLOCK = re.compile(_OPEN + r"\n.*?\n<!-- end of keel paper-report: (?P=name) -->$", re.S | re.M)


def begin(name: str) -> str:
    return f"<!-- keel paper-report: {name} -->"


def end(name: str) -> str:
    return f"<!-- end of keel paper-report: {name} -->"


def mark_tables(text: str) -> str:
    """The report's text with each table (a run of lines starting with '|') between the markers of its name."""
    out: list[str] = []
    section, count = "", 0
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section, count = _name(line[3:]), 0
        is_row, was_row = line.startswith("|"), i > 0 and lines[i - 1].startswith("|")
        if is_row and not was_row:
            count += 1
            name = section if count == 1 else f"{section}, table {count}"
            out.append(begin(name))
        if was_row and not is_row:
            out.append(end(name))
        out.append(line)
    if lines[-1].startswith("|"):
        out.append(end(name))
    return "\n".join(out)


def _name(heading: str) -> str:
    """A section's name for its blocks: its heading without what follows a ';' in its closing parenthesis (the ramp,
    or how many runs have finished: a block keeps its name as the records grow)."""
    return re.sub(r"; [^()]*\)$", ")", heading)


def blocks(text: str) -> dict[str, str]:
    """name -> the whole marked block (markers included), for every block in text; a block whose end marker is
    missing is an error, not a block that runs to the end of the page, and so is a name marked twice."""
    found: dict[str, str] = {}
    for match in _BLOCK.finditer(text):
        if match["name"] in found:
            raise ConfigError(f"paper-report: block {match['name']!r} is marked twice")
        found[match["name"]] = match[0]
    if unclosed := [m["name"] for m in re.finditer(_OPEN, text, re.M) if m["name"] not in found]:
        raise ConfigError(f"paper-report: block {unclosed[0]!r} has no line {end(unclosed[0])!r} after it")
    return found


def write_docs(report_text: str, docs: Path) -> list[tuple[Path, str, str]]:
    """Replace each marked block of docs/*.md by the report's block of that name; (page, name, what happened) for
    every block a page holds: "rewritten", "unchanged", or "not in the report" (its grids not run under the
    report's DIR: the page's block is left as it is). Every page is read and checked before any is written, and each
    is replaced whole (a temporary file renamed over it)."""
    written = blocks(report_text)
    done, pages = [], {}
    for page in sorted(docs.glob("*.md")):
        text = new = page.read_text()
        for name, block in blocks(text).items():
            if name not in written:
                done.append((page, name, "not in the report"))
                continue
            new = new.replace(block, written[name])
            done.append((page, name, "unchanged" if block == written[name] else "rewritten"))
        if new != text:
            pages[page] = new
    for page, text in pages.items():
        staging = page.with_name(f".{page.name}.tmp{os.getpid()}")
        staging.write_text(text)
        os.replace(staging, page)
    return done
