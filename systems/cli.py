"""What the drivers check before they load anything: every flag against its range, every file and
folder a flag names. One error class, `runtime.UserError`, carries a one-line message
"<what is wrong> — <how to fix it>"; only the drivers' `__main__` turns it into `error: ...` and
exit status 2 (`run`). Any other exception is a bug and keeps its traceback.

    RANGES = {"steps": Range(int, low=1), "lr": Range(float, low=0, low_open=True)}
    check_ranges(vars(args), RANGES)         # raises UserError naming the flag and its range
    rows = read_jsonl("--prompts", path)     # a broken line names the file and its line
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys

# the ranges live in runtime.py, beside the configs that use them; the drivers import them here
from runtime import Range, UserError, check_ranges, flag_name  # noqa: F401


class Parser(argparse.ArgumentParser):
    """argparse with its own errors (unknown flag, a word where a number goes) as a UserError:
    one line, exit status 2, like every other bad input."""

    def error(self, message):
        raise UserError(f"{self.prog}: {message} — see `{self.prog} --help`")


def run(main, *args, **kwargs):
    """Call a driver's main; a UserError becomes one line on stderr and exit status 2."""
    try:
        return main(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------------------------------
# Files and folders a flag names


def check_file(flag: str, path: str) -> str:
    """A file that exists, is a file, can be read and is not empty."""
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: no such file — check the path")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder — give a file")
    if not os.access(path, os.R_OK):
        raise UserError(f"{flag} {path} cannot be read — check its permissions")
    if os.path.getsize(path) == 0:
        raise UserError(f"{flag} {path} is empty — give a file with content")
    return path


def read_jsonl(flag: str, path: str, fields: str = "a JSON object") -> list[dict]:
    """The rows of a JSON Lines file; a line that is not one JSON object names the file, the
    line and what each line should hold (`fields`)."""
    check_file(flag, path)
    rows = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError:
            raise UserError(f"{flag} {path} is not UTF-8 text — give a JSON Lines file") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{flag} {path} line {n}: not JSON ({e.msg}) — each line must be {fields}"
            ) from None
        if not isinstance(row, dict):
            raise UserError(
                f"{flag} {path} line {n}: not a JSON object — each line must be {fields}"
            )
        rows.append(row)
    if not rows:
        raise UserError(f"{flag} {path} holds no JSON lines — give a file with one object a line")
    return rows


def read_json(flag: str, path: str) -> dict:
    """One JSON object from a file, or a UserError naming the file."""
    check_file(flag, path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        message = f"{flag}: {path} is not valid JSON ({e}) — restore or rewrite it"
        raise UserError(message) from None
    if not isinstance(value, dict):
        raise UserError(f"{flag}: {path} holds no JSON object — restore or rewrite it")
    return value


def check_safetensors(flag: str, path: str) -> None:
    """A .safetensors file whose header parses and whose size matches what the header says:
    a file cut short (a copy or a save that was killed) is named before torch reads it."""
    check_file(flag, path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{flag}: {path} is cut short (no header) — restore or re-save it")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise UserError(f"{flag}: {path} is cut short (header) — restore or re-save it")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(
                f"{flag}: {path} is not a safetensors file — restore or re-save it"
            ) from None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    data_end = max(ends, default=0)
    if 8 + header_len + data_end != size:
        raise UserError(
            f"{flag}: {path} is cut short ({size} of {8 + header_len + data_end} "
            "bytes) — restore or re-save it"
        )


def looks_like_hub_name(path: str) -> bool:
    """'owner/name' or 'name': what the model hub could hold. './x', '/x' and 'a/b/c' are paths."""
    if os.path.isabs(path) or path.startswith("."):
        return False
    return path.count("/") <= 1 and path.strip() != ""


def check_model_folder(flag: str, path: str, what: str = "an HF model") -> str:
    """A folder an HF causal LM loads from: config.json and whole weight files. A name that is
    no path on disk is left to the hub."""
    if not os.path.exists(path):
        if looks_like_hub_name(path):
            return path
        raise UserError(f"{flag} {path}: no such folder — check the path")
    if not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder — give {what} folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(
            f"{flag} {path} is not {what} folder (no config.json) — give a folder "
            "that save_pretrained wrote"
        )
    read_json(flag, os.path.join(path, "config.json"))
    weights = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    if not weights and not any(n.endswith(".bin") for n in os.listdir(path)):
        raise UserError(
            f"{flag} {path} holds no weights (no .safetensors file) — give a folder "
            "that save_pretrained wrote"
        )
    for name in sorted(weights):
        check_safetensors(flag, os.path.join(path, name))
    return path


def check_drafter_folder(flag: str, path: str) -> str:
    """A D3D drafter folder: an HF model folder plus d3d_config.json."""
    if not os.path.isdir(path):
        if os.path.exists(path):
            fix = "give a drafter folder that train.py wrote"
            raise UserError(f"{flag} {path} is a file, not a folder — {fix}")
        raise UserError(
            f"{flag} {path}: no such folder — train one with `python train.py`, or check the path"
        )
    if not os.path.isfile(os.path.join(path, "d3d_config.json")):
        raise UserError(
            f"{flag} {path} is not a D3D drafter (no d3d_config.json) — give a "
            "folder that train.py wrote"
        )
    read_json(flag, os.path.join(path, "d3d_config.json"))
    return check_model_folder(flag, path, what="a D3D drafter")
