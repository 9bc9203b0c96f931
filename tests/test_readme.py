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
import subprocess
import sys

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


REDRAW = "Redraw the pictures"
# the flags whose value is a file or folder a command writes
OUTPUT_FLAGS = ("--out", "--plot", "--training-png", "--branch-png", "--trace", "--json")
TRACKED = ("pictures/", "toy-target/")


def commands(block: str) -> list[str]:
    """The commands of a fenced block, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def bash_blocks(text: str) -> list[tuple[str, str]]:
    """(the heading above it, its text) for each ```bash block."""
    found = []
    heading = ""
    for part in re.split(r"^(```bash\n.*?^```)", text, flags=re.M | re.S):
        if part.startswith("```bash"):
            found.append((heading, part[len("```bash\n") : -3]))
            continue
        headings = re.findall(r"^#{1,6} +(.+?) *$", part, flags=re.M)
        if headings:
            heading = headings[-1]
    return found


def outputs(command: str) -> list[str]:
    """The paths a command's output flags name."""
    words = command.split()
    return [words[i + 1] for i, word in enumerate(words[:-1]) if word in OUTPUT_FLAGS]


def redraw_commands() -> list[str]:
    blocks = [block for heading, block in bash_blocks(read("LAB.md")) if heading == REDRAW]
    assert len(blocks) == 1, f'LAB.md needs one ```bash block under "## {REDRAW}"'
    return commands(blocks[0])


def test_every_picture_in_the_repository_is_redrawn_by_labs_redraw_block():
    """Each PNG in pictures/ is written by a command of LAB's one "Redraw the pictures" block."""
    shipped = [p for p in project_files(".png", names=["pictures"]) if p.startswith("pictures/")]
    if not shipped:
        pytest.skip("no pictures in pictures/")
    written = {path for command in redraw_commands() for path in outputs(command)}
    unexplained = sorted(set(shipped) - written)
    assert not unexplained, f"no command of LAB's {REDRAW!r} block draws {unexplained}"


def test_no_exercise_command_writes_under_pictures_or_toy_target():
    """Outside the redraw block, every command of README and LAB writes under runs/ (or a
    folder of the user's), never over a tracked picture or the shipped toy."""
    assert outputs("python decode.py --plot pictures/a.png --out runs/x") == [
        "pictures/a.png",
        "runs/x",
    ]
    overwriting = []
    for doc in ("README.md", "LAB.md"):
        for heading, block in bash_blocks(read(doc)):
            if doc == "LAB.md" and heading == REDRAW:
                continue
            for command in commands(block):
                tracked = [p for p in outputs(command) if p.startswith(TRACKED)]
                if tracked:
                    overwriting.append(f"{doc} ({heading}): {command}")
    assert not overwriting, "commands that write over tracked files:\n" + "\n".join(overwriting)


def test_results_opens_with_a_contents_list_of_its_sections():
    text = read("RESULTS.md")
    headings = re.findall(r"^## +(.+)$", outside_code(text), flags=re.M)
    head = text.split("\n## ", 1)[0]
    listed = re.findall(r"\]\(#([^)]+)\)", head)
    assert listed == [anchor(h) for h in headings]


def test_readmes_program_runs_where_and_as_readme_says(tmp_path):
    """README's "Watch a round" program, saved where README says in a copy of the repository
    (with an untrained drafter at runs/toy/drafter), runs as README says."""
    import shutil

    import torch
    import transformers

    import d3d
    import lab

    text = read("README.md")
    section = text[text.index("## Watch a round") :]
    saved_as = re.search(r"save it as `(\w+\.py)` in the repository's folder", section)
    run_as = re.search(r"run `python (\w+\.py)` there", section)
    assert saved_as and run_as, "README says where to save its program and how to run it"
    assert saved_as.group(1) == run_as.group(1)
    program = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    copy = tmp_path / "repo"
    lab.copy_project(ROOT, str(copy))
    shutil.rmtree(copy / "runs", ignore_errors=True)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "toy-target"))
    config = transformers.AutoConfig.from_pretrained(os.path.join(ROOT, "toy-target"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4)
    drafter.save_pretrained(str(copy / "runs" / "toy" / "drafter"), tok)
    (copy / saved_as.group(1)).write_text(program)
    ran = subprocess.run(
        [sys.executable, run_as.group(1)], cwd=copy, capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "round 0" in ran.stdout and "(tau " in ran.stdout, ran.stdout[-2000:]


def test_readme_counts_both_kinds_of_exercise_as_lab_does():
    """README's counts of LAB's ablations (LAB's table) and of its write-it-yourself exercises
    (lab.py list), each named apart."""
    import lab

    text = " ".join(read("README.md").split())
    lab_md = read("LAB.md")
    table = lab_md[lab_md.index("| # | exercise |") :].split("\n\n")[0]  # LAB's opening table
    ablations = re.findall(r"^\| (\d+) \| ", table, flags=re.M)
    assert ablations == [str(n) for n in range(1, len(ablations) + 1)], ablations
    assert f"Its {len(ablations)} ablations" in text
    assert f"Its {len(lab.EXERCISES)} write-it-yourself exercises" in text
