"""Links between the docs resolve: every relative link in README.md and docs/*.md names a file
that exists, and a #anchor names a heading of that file (GitHub's heading ids)."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = sorted([os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code spans hold examples, not links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+\1", "", text)


def slug(heading: str) -> str:
    """GitHub's id for a heading: its text (link targets, emphasis and code marks dropped), lower
    case, punctuation other than '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """The ids of a markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    with open(path, encoding="utf-8") as f:
        text = prose(f.read())
    seen, ids = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [target for target in LINK.findall(prose(f.read()))
                if not re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.I)]  # http:, mailto:, ...


def test_slug_follows_github():
    assert slug("Dense step vs transformers and Liger") == "dense-step-vs-transformers-and-liger"
    assert slug("GPT-OSS") == "gpt-oss"
    assert slug("`oomb plan`: memory before a run") == "oomb-plan-memory-before-a-run"
    assert slug("Kernels vs cuDNN (H200)") == "kernels-vs-cudnn-h200"


def test_prose_drops_code():
    text = "see [a](a.md)\n```bash\n[b](b.md)\n```\nand `[c](c.md)`"
    assert LINK.findall(prose(text)) == ["a.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        if not os.path.exists(file):
            broken.append(f"{target}: no file {os.path.relpath(file, ROOT)}")
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not broken, "\n".join(broken)


def test_tests_the_docs_name_exist():
    """Every `tests/<file>.py::<test>` the docs cite (the error table) is a test that exists."""
    cited = set()
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            cited |= set(re.findall(r"(tests/\w+\.py)::(\w+)", f.read()))
    assert len(cited) >= 10
    for file, name in sorted(cited):
        with open(os.path.join(ROOT, file), encoding="utf-8") as f:
            assert re.search(rf"^def {name}\(", f.read(), flags=re.M), f"{file}::{name}"
