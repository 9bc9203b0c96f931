"""House style that a test can hold: every Python file of the project fits half a screen.

The reader has the paper open beside the code, which leaves about 100 columns. ruff's formatter
and linter hold the same limit (pyproject.toml, .ci/run); this test holds it without ruff, so
the suite alone catches a long line."""

import os
import subprocess
import unicodedata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_COLUMNS = 100  # pyproject.toml's line-length
SHOWN = 20  # offenders named in a failure
# where ruff does not look either (pyproject.toml's extend-exclude), and what git ignores
SKIPPED = {"runs", "toy-target", "__pycache__"}


def python_files() -> list[str]:
    """The project's .py files, relative to ROOT: what git tracks, and new files it does not
    ignore. Outside a git checkout, every .py file but those in hidden or SKIPPED folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED]
            for name in files:
                if name.endswith(".py"):
                    listed.append(os.path.relpath(os.path.join(folder, name), ROOT))
    # a file deleted but not yet committed is still listed
    return sorted(p for p in set(listed) if os.path.isfile(os.path.join(ROOT, p)))


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
