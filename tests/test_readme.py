"""Every link between the documents lands somewhere: each `[..](RESULTS.md#anchor)` and
`[..](LAB.md#anchor)` (and `(#anchor)` inside a document) names a heading that exists, and each
`pictures/*.png` a README, LAB or RESULTS shows is in the repository.

Anchors follow GitHub's rule: the heading's text lowercased, every character but letters, digits,
spaces, '-' and '_' dropped, spaces turned into '-'; a repeated heading gets -1, -2, ...

Run: python -m pytest -q tests/test_readme.py
"""

import collections
import os
import re

import pytest
from project_files import project_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "LAB.md", "RESULTS.md")
LINK = re.compile(r"\]\(([A-Z]+\.md)?#([^)\s]+)\)")  # ](RESULTS.md#speed) or ](#speed)
PICTURE = re.compile(r"pictures/[\w.-]+\.png")


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def outside_code(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` there is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())  # markup (`, *) goes with the rest
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor the document's headings make, repeats numbered."""
    seen = collections.Counter()
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", outside_code(text), flags=re.M):
        name = anchor(heading)
        found.add(name if seen[name] == 0 else f"{name}-{seen[name]}")
        seen[name] += 1
    return found


def test_the_anchor_rule_is_githubs():
    assert anchor("Speed on the toy (Fig. 1c)") == "speed-on-the-toy-fig-1c"
    assert anchor("Tables 6 and 7: selective prefilling") == "tables-6-and-7-selective-prefilling"
    assert anchor("`lab.py`: write it yourself") == "labpy-write-it-yourself"
    assert anchor("Qwen3 on one GPU") == "qwen3-on-one-gpu"
    assert anchor("τ by step") == "τ-by-step"  # letters of any script stay
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B_c\n") == {"a", "a-1", "b_c"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_to_a_section_lands_on_a_heading(doc):
    text = outside_code(read(doc))
    links = LINK.findall(text)
    missing = []
    for target, name in links:
        if not target:
            target = doc
        if name not in anchors(read(target)):
            missing.append(f"{target}#{name}")
    assert not missing, f"{doc} links to sections that no heading makes: {missing}"


def test_readme_links_to_results_by_section():
    """README points into RESULTS by anchor, so that a browser jumps to the table."""
    targets = {target for target, _ in LINK.findall(outside_code(read("README.md")))}
    assert "RESULTS.md" in targets


@pytest.mark.parametrize("doc", DOCS)
def test_every_picture_shown_is_in_the_repository(doc):
    missing = [p for p in PICTURE.findall(read(doc)) if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"{doc} shows pictures that are not in pictures/: {missing}"


def test_every_picture_in_the_repository_says_how_it_was_drawn():
    """Each PNG in pictures/ is named next to a command in README or LAB that draws it."""
    shipped = [p for p in project_files(".png", names=["pictures"]) if p.startswith("pictures/")]
    if not shipped:
        pytest.skip("no pictures in pictures/")
    text = re.sub(r"\\\n\s*", " ", read("README.md") + read("LAB.md"))  # continuations joined
    unexplained = []
    for path in shipped:
        lines = [line for line in text.splitlines() if path in line]
        drawn = [line for line in lines if "python" in line and ("--plot" in line or "png" in line)]
        if not drawn:
            unexplained.append(path)
    assert not unexplained, f"no command in README or LAB draws {unexplained}"


def test_results_opens_with_a_contents_list_of_its_sections():
    text = read("RESULTS.md")
    headings = re.findall(r"^## +(.+)$", outside_code(text), flags=re.M)
    head = text.split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", head)
    assert listed == [anchor(h) for h in headings]
