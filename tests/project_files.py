"""The project's own files, for the tests that read the source tree: what git tracks, so a script
a user keeps beside d3d.py (README's example, say) is not read as part of the project.

Outside a git checkout (a copy, an unpacked archive) the project's files are found by name: each
of NAMES that is a top-level module, or a folder of the project's, with that folder's files."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the project's top-level modules and its folders of Python files, by name
NAMES = ("runtime", "d3d", "toy", "train", "decode", "lab", "test_d3d", "systems", "tests")
SKIPPED = ("__pycache__",)  # folders of what Python writes, never the project's


def tracked() -> list[str] | None:
    """Every file git tracks under ROOT, relative to ROOT, '/' between folders; None when ROOT is
    not a git checkout of the project (no git, or no repository that tracks d3d.py here). A
    worktree, whose .git is a file, is a checkout like any other: git finds its repository."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        )
        paths = [p for p in listed.stdout.decode("utf-8").split("\0") if p]
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return None
    if "d3d.py" not in paths:
        return None
    # a file deleted but not yet committed is still in git's index
    return sorted(p for p in set(paths) if os.path.isfile(os.path.join(ROOT, p)))


def by_name(names) -> list[str]:
    """The files that `names` name under ROOT: `name.py` where it is a file, and every file in
    the folder `name` where that is a folder (hidden folders and SKIPPED left out)."""
    found = []
    for name in names:
        if os.path.isfile(os.path.join(ROOT, f"{name}.py")):
            found.append(f"{name}.py")
        for folder, dirs, files in os.walk(os.path.join(ROOT, name)):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED)
            for file in files:
                path = os.path.relpath(os.path.join(folder, file), ROOT)
                found.append(path.replace(os.sep, "/"))
    return sorted(set(found))


def project_files(suffix: str = ".py", names=NAMES) -> list[str]:
    """The project's files ending in `suffix`, relative to ROOT with '/' between folders: those
    git tracks in a checkout, otherwise those that `names` name (see by_name)."""
    paths = tracked()
    if paths is None:
        paths = by_name(names)
    return [p for p in paths if p.endswith(suffix)]
