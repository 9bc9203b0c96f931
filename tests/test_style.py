"""House style that a test can hold: every Python file of the project fits half a screen.

The reader has the paper open beside the code, which leaves about 100 columns. ruff's formatter
and linter hold the same limit (pyproject.toml, .ci/run); this test holds it without ruff, so
the suite alone catches a long line."""

import os
import unicodedata

import pytest
from project_files import NAMES, by_name, project_files, tracked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_COLUMNS = 100  # pyproject.toml's line-length
SHOWN = 20  # offenders named in a failure


def python_files() -> list[str]:
    """The project's .py files, relative to ROOT: what git tracks (project_files.py), so a
    script of the user's own beside the code is not held to the project's style."""
    return project_files(".py")


def columns(line: str) -> int:
    """The columns a line takes on screen: a wide character (CJK, some symbols) takes two."""
    width = 0
    for character in line:
        if unicodedata.east_asian_width(character) in ("W", "F"):
            width += 2
        else:
            width += 1
    return width


def long_lines(path: str) -> list[str]:
    """'file:line (columns)' for each line of `path` past MAX_COLUMNS."""
    found = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            width = columns(line.rstrip("\r\n"))
            if width > MAX_COLUMNS:
                found.append(f"{path}:{number} ({width} columns)")
    return found


def test_every_python_line_fits_in_100_columns():
    files = python_files()
    assert "d3d.py" in files and "tests/test_style.py" in files, files
    offenders = []
    for path in files:
        offenders += long_lines(path)
    if not offenders:
        return
    shown = "\n".join(offenders[:SHOWN])
    more = ""
    if len(offenders) > SHOWN:
        more = f"\n... and {len(offenders) - SHOWN} more"
    pytest.fail(
        f"{len(offenders)} lines are wider than {MAX_COLUMNS} columns: wrap them by hand "
        f"(a trailing comment goes on its own line above; `ruff format` wraps code):\n"
        f"{shown}{more}",
        pytrace=False,
    )


def test_the_project_found_by_name_holds_every_file_git_tracks():
    """Outside a git checkout the tests find the project's Python files by name (NAMES): those
    names must reach every .py file git tracks, or a copy of the project would test less."""
    listed = tracked()
    if listed is None:
        pytest.skip("not a git checkout: no list of tracked files to compare with")
    missing = sorted({p for p in listed if p.endswith(".py")} - set(by_name(NAMES)))
    assert not missing, f"add their module or folder to NAMES in tests/project_files.py: {missing}"
