"""The drivers' flags, read from the settings' dataclasses, and what the drivers check before they
load anything: every flag against its range, every file and folder a flag names.

A setting is written once, on its dataclass field (runtime.setting, or `flag` for a driver's own
setting that argparse spells in its own way): its name, default, range and help. `add_settings`
makes one argparse group of a dataclass (field_name -> --field-name), `check_flags` checks the
parsed values against the same ranges. One error class, `runtime.UserError`, carries a one-line
message "<what is wrong> — <how to fix it>"; only the drivers' `__main__` turns it into
`error: ...` and exit status 2 (`run`). Any other exception is a bug and keeps its traceback.

    GROUPS = {"data": DataSettings, "the method": (d3d.D3DConfig, NOT_FLAGS)}
    add_groups(parser, GROUPS)               # --help: a group per dataclass
    check_flags(vars(args), GROUPS)          # raises UserError naming the flag and its range
    rows = read_jsonl("--prompts", path)     # a broken line names the file and its line
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import struct
import sys
import warnings

# the ranges live in runtime.py, beside the configs that use them; the drivers import them here
from runtime import Range, UserError, check_ranges, flag_name  # noqa: F401

# a field's metadata key for how argparse spells it: flag=, action=, nargs=, metavar=, const=
SPELLING = "argparse"
# every driver's --dtype: a name of runtime.resolve_dtype's
DTYPE_RANGE = Range(str, choices=("auto", "float32", "bfloat16"))


class Parser(argparse.ArgumentParser):
    """argparse with its own errors (unknown flag, a word where a number goes) as a UserError:
    one line, exit status 2, like every other bad input. Its usage line names no flag: --help
    spells each flag once, in its group."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("usage", "%(prog)s [flags]")
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(f"{self.prog}: {message} — see `{self.prog} --help`")


def warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the drivers print it: one line, no source location."""
    return f"warning: {message}\n"


def run(main, *args, **kwargs):
    """Call a driver's main; a UserError becomes one line on stderr and exit status 2, and a
    warning (a drafter used at another B than it was trained with, ...) one line too."""
    warnings.formatwarning = warning_line
    try:
        return main(*args, **kwargs)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------------------------------
# Flags from dataclass fields


def flag(default, help: str, range: Range | None = None, **spelling):
    """A driver's own setting as a dataclass field: runtime.setting's default, help and range,
    and how argparse spells it where the rule does not (flag="--bench", action="append",
    nargs="+", metavar="PATH", const="whole")."""
    metadata = {"help": help, "range": range, SPELLING: spelling}
    return dataclasses.field(default=default, metadata=metadata)


def flag_fields(kind: type, skip=()) -> list[dataclasses.Field]:
    """The fields of `kind` that are flags: those with a help, but the `skip`ped."""
    return [f for f in dataclasses.fields(kind) if "help" in f.metadata and f.name not in skip]


def add_settings(parser, kind: type, title: str, *, skip=(), later=None, defaults=None):
    """One argparse group of `title` with a flag for each field of `kind` (flag_fields): help
    and range from the field's metadata, the field's default ("(default: ...)" added to the help
    unless it is None or a bool, or the help says it in words). `later`: {field: words} for
    defaults the run decides (the flag's default is None, the words go in the help).
    `defaults`: {field: value} where the driver's default is not the field's. The field's range
    gives the flag its type, choices and nargs; a driver's narrower bounds are check_flags's."""
    group = parser.add_argument_group(title)
    for f in flag_fields(kind, skip):
        options = dict(f.metadata.get(SPELLING, {}))
        name = options.pop("flag", flag_name(f.name))
        allowed = f.metadata.get("range")
        default = (defaults or {}).get(f.name, f.default)
        help = f.metadata["help"]
        if later and f.name in later:
            default = None
            help += f" (default: {later[f.name]})"
        elif default is not None and not isinstance(default, bool) and "(default:" not in help:
            shown = default
            if isinstance(default, (list, tuple)):
                shown = " ".join(str(v) for v in default)
            help += f" (default: {shown})"
        # argparse formats help with %: a literal % is written twice
        options["help"] = help.replace("%", "%%")
        options["dest"] = f.name
        options["default"] = default
        if allowed is not None and allowed.kind is bool:
            options.setdefault("action", "store_false" if default else "store_true")
        elif "action" not in options or options["action"] == "append":
            options["type"] = str
            if allowed is not None:
                options["type"] = allowed.kind
                if allowed.choices is not None:
                    options["choices"] = allowed.choices
                if allowed.each and "action" not in options:
                    options.setdefault("nargs", "+")
        group.add_argument(name, **options)
    return group


def group_kinds(groups: dict):
    """(kind, skip) of each group of a driver: {title: kind, or (kind, fields that are no
    flags)}."""
    for value in groups.values():
        if isinstance(value, tuple):
            yield value
        else:
            yield value, ()


def add_groups(parser, groups: dict, **options) -> None:
    """A driver's flags: one add_settings group per entry of `groups` (group_kinds); `options`:
    add_settings's later and defaults."""
    for title, (kind, skip) in zip(groups, group_kinds(groups)):
        add_settings(parser, kind, title, skip=skip, **options)


def flag_ranges(groups: dict, narrower=None) -> tuple[dict, dict]:
    """(ranges, flags) of a driver's flags, as check_ranges takes them: {field: Range} and
    {field: its flag} for every field whose flag is not --field-name. `narrower`: {field: Range}
    where a driver takes less than the field."""
    ranges = {}
    flags = {}
    for kind, skip in group_kinds(groups):
        for f in flag_fields(kind, skip):
            spelling = f.metadata.get(SPELLING, {})
            if "flag" in spelling:
                flags[f.name] = spelling["flag"]
            allowed = (narrower or {}).get(f.name, f.metadata.get("range"))
            if allowed is not None:
                ranges[f.name] = allowed
    return ranges, flags


def check_flags(values: dict, groups: dict, narrower=None) -> None:
    """Every flag of a driver in its range (None: not given): one UserError naming the flag."""
    ranges, flags = flag_ranges(groups, narrower)
    check_ranges(values, ranges, flags)


def settings_of(kind: type, values: dict, skip=(), **more):
    """A `kind` made from the parsed flags that are its fields (and `more`)."""
    given = {f.name: values[f.name] for f in flag_fields(kind, skip) if f.name in values}
    return kind(**{**given, **more})


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
    stated_size = 8 + header_len + max(ends, default=0)
    if stated_size != size:
        raise UserError(
            f"{flag}: {path} is cut short ({size} of {stated_size} bytes) — restore or re-save it"
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
    names = os.listdir(path)
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if not weights and not any(n.endswith(".bin") for n in names):
        raise UserError(
            f"{flag} {path} holds no weights (no .safetensors file) — give a folder "
            "that save_pretrained wrote"
        )
    for name in weights:
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
