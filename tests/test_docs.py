"""Every command in README.md, LAB.md and RESULTS.md parses: each `python SCRIPT ...` (or torchrun)
line in a fenced block, and each inline one that names no placeholder, runs its script's own
argument parser, stopped right after it parsed. A flag renamed in the code and not in the docs fails
here.

Run: python -m pytest -q tests/test_docs.py
"""

import argparse
import os
import re
import runpy
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "LAB.md", "RESULTS.md")
SCRIPTS = ("train.py", "decode.py", "toy.py", "tests/gpu_check.py", "tests/lab_runs.py", "lab.py")


def fenced_lines(text: str) -> list[str]:
    """Lines of the fenced code blocks, with backslash continuations joined."""
    lines, inside = [], False
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    return lines


def is_pattern(span: str) -> bool:
    """An inline span that shows a pattern, not a command: [optional parts], ..., or placeholders
    such as N, F1, λ."""
    return any(mark in span for mark in ("[", "...", "…", "λ", "$")) or any(
        re.fullmatch(r"[A-Z][A-Z0-9]*", token) for token in span.split()
    )


def commands(doc: str) -> list[tuple[str, list[str]]]:
    """(script, argv) of every command the doc shows."""
    text = open(os.path.join(ROOT, doc)).read()
    candidates = fenced_lines(text)
    candidates += [
        span
        for span in re.findall(r"`([^`\n]*(?:python|torchrun)[^`\n]*)`", text)
        if not is_pattern(span)
    ]
    loops = re.findall(r"\bfor (\w+) in (\S+)", text)  # a shell loop's variable: its first value
    found = []
    for candidate in candidates:
        for var, value in loops:
            candidate = candidate.replace(f"${var}", value)
        for part in re.split(r"&&|;", candidate):
            try:
                tokens = shlex.split(part, comments=True)
            except ValueError:
                continue
            tokens = tokens[
                : next(
                    (i for i, t in enumerate(tokens) if t.startswith((">", "2>", "|"))), len(tokens)
                )
            ]
            script = next((i for i, t in enumerate(tokens) if t in SCRIPTS), None)
            if script is not None and any(
                t in ("python", "python3", "torchrun") for t in tokens[:script]
            ):
                found.append((tokens[script], tokens[script + 1 :]))
    return found


class Parsed(Exception):
    pass


def parse_only(script: str, argv: list[str]) -> argparse.Namespace:
    """Run `script` as __main__ with argv until its argument parser returns; argparse's own error is
    a SystemExit."""
    real = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    saved = sys.argv
    sys.argv = [script] + argv
    argparse.ArgumentParser.parse_args = stop_after_parsing
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    except Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = saved
    raise AssertionError(f"{script} {shlex.join(argv)} finished without parsing its arguments")


ALL = [(doc, script, argv) for doc in DOCS for script, argv in commands(doc)]


def test_the_docs_show_the_commands_of_every_script():
    assert len(ALL) > 40
    assert {script for _, script, _ in ALL} == set(SCRIPTS)
    assert (
        "RESULTS.md",
        "train.py",
        [
            "prune",
            "--drafter",
            "runs/smollm2/full",
            "--min-layers",
            "15",
            "--recovery-steps",
            "4",
            "--num-val",
            "12",
            "--val-anchors",
            "16",
            "--batch-size",
            "4",
            "--dtype",
            "bfloat16",
        ],
    ) in [(doc, script, argv[:15]) for doc, script, argv in ALL]


@pytest.mark.parametrize(
    "doc,script,argv", ALL, ids=[f"{d}:{s} {' '.join(a)[:60]}" for d, s, a in ALL]
)
def test_every_documented_command_parses(doc, script, argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    parse_only(script, argv)


def test_lab_md_shows_every_lab_command_and_a_start_and_check_of_every_exercise():
    """LAB.md's "Write it yourself": every `python lab.py ...` there parses with lab.py's own
    parser (the test above), all four commands show, and every exercise a start and a check."""
    shown = [argv for doc, script, argv in ALL if doc == "LAB.md" and script == "lab.py"]
    assert {argv[0] for argv in shown} == {"list", "start", "check", "handout"}
    for exercise in runpy.run_path(os.path.join(ROOT, "lab.py"))["EXERCISES"]:
        assert ["start", exercise.name] in shown and ["check", exercise.name] in shown, (
            exercise.name
        )


def test_every_picture_lab_md_shows_is_in_the_repository():
    """Each `![...](PATH)` of LAB.md names a file of the repository, by a relative path."""
    text = open(os.path.join(ROOT, "LAB.md")).read()
    shown = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert len(shown) >= 5
    missing = [path for path in shown if not os.path.isfile(os.path.join(ROOT, path))]
    assert not missing, missing
