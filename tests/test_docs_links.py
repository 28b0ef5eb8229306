"""Every relative link in the README and docs/ reaches a file of the repository and, where it names one, a heading of
that page (GitHub's anchors: lowercased, punctuation dropped, spaces as hyphens, repeats numbered)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_code_blocks(page: Path) -> str:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"^    .*$", "", text, flags=re.MULTILINE)


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", without_code_blocks(page), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for page in PAGES:
        # inline code holds formulas such as `[Norm_out](x)`, not links
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]*`", "", without_code_blocks(page))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to no file or heading:\n" + "\n".join(broken)
