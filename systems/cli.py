"""The drivers' flags, read from the settings' dataclasses, and what the drivers check before they
load anything: every flag against its range, every file and folder a flag names, and every path
a command writes (check_output: the one rule of what it may write over).

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
    check_output("--out", args.out, TRAINING_RUN, args.force)  # before anything is written
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pickle
import struct
import sys
import warnings
from collections.abc import Callable

import torch

import runtime

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
        check_finished(flag, path)
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
    if is_toy(path):
        # a toy target: every file as its toy.json records it
        check_toy(flag, path)
    return path


def check_drafter_folder(flag: str, path: str) -> str:
    """A D3D drafter folder: an HF model folder plus d3d_config.json; a folder that holds only
    a stopped training run is named as one (check_finished)."""
    if not os.path.isdir(path):
        if os.path.exists(path):
            fix = "give a drafter folder that train.py wrote"
            raise UserError(f"{flag} {path} is a file, not a folder — {fix}")
        raise UserError(
            f"{flag} {path}: no such folder — train one with `python train.py`, or check the path"
        )
    if not os.path.isfile(os.path.join(path, "d3d_config.json")):
        check_finished(flag, path)
        raise UserError(
            f"{flag} {path} is not a D3D drafter (no d3d_config.json) — give a "
            "folder that train.py wrote"
        )
    read_json(flag, os.path.join(path, "d3d_config.json"))
    return check_model_folder(flag, path, what="a D3D drafter")


# what train.py writes into its --out besides the drafter: its checkpoint (systems/distributed.py;
# under --fsdp a folder) and the record it ends with; `train.py prune` adds its table
CHECKPOINT = "checkpoint.pt"
SHARDED_CHECKPOINT = "checkpoint-fsdp"
TRAIN_RECORD = "train_args.json"
PRUNE_TABLE = "prune_table.json"


def check_finished(flag: str, path: str) -> None:
    """A folder that holds train.py's checkpoint but no drafter yet (a run stopped before its
    end, by Ctrl-C, SIGTERM or a crash) is named as such: the step it stopped at and the
    command that finishes it. Any other folder is left to the caller's check."""
    command = None
    if os.path.exists(os.path.join(path, CHECKPOINT)):
        command = "python train.py"
    elif os.path.exists(os.path.join(path, SHARDED_CHECKPOINT)):
        command = "torchrun --nproc_per_node=N train.py --fsdp"
    if command is None:
        return
    raise UserError(
        f"{flag} {path} holds an unfinished training run, {stopped_at(path)} — finish it "
        f"with `{command} --out {path}` and the flags that started it"
    )


def stopped_at(path: str) -> str:
    """'stopped at step N': the step of the checkpoint in train.py's --out `path` (plain or
    sharded, systems/distributed.py), read without its tensors."""
    saved = os.path.join(path, CHECKPOINT)
    if not os.path.exists(saved):
        saved = os.path.join(path, SHARDED_CHECKPOINT, "train_state.pt")
    unreadable = f"its checkpoint unreadable ({os.path.relpath(saved, path)})"
    try:
        # mmap: the tensors stay on disk, only the small record is read
        state = torch.load(saved, map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        return unreadable
    if not isinstance(state, dict) or "step" not in state:
        return unreadable
    return f"stopped at step {state['step']}"


# --------------------------------------------------------------------------------------------------
# The toy target (toy.py): a folder that holds toy.json is checked against it wherever it is read

# in every toy folder: how it was built, how well it answers, and the fingerprints of its files
TOY_RECIPE = "toy.json"
# the toy the repository ships: every command reads it, none writes it (toy.py builds others)
TOY_TARGET = os.path.join(runtime.REPOSITORY, "toy-target")
# the prompt files of a toy folder, and the target's answers to them
TOY_FILES = {
    "train": "prompts-train.jsonl",
    "test": "prompts-test.jsonl",
    "train_answers": "answers-train.jsonl",
    "test_answers": "answers-test.jsonl",
}


def sha256_file(path: str) -> str:
    """The file's sha256, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(folder: str, tok=None) -> dict:
    """What identifies a toy target: the sha256 of its weights file and its tokenizer's
    fingerprint."""
    if tok is None:
        tok = runtime.load_tokenizer(folder)
    return {
        "weights_sha256": sha256_file(os.path.join(folder, "model.safetensors")),
        "tokenizer": runtime.tokenizer_fingerprint(tok),
    }


def is_toy(path: str | None) -> bool:
    """Whether `path` is a toy folder: one that holds toy.json."""
    return path is not None and os.path.isfile(os.path.join(path, TOY_RECIPE))


def toy_restore(folder: str) -> str:
    """How to get a toy folder back as its toy.json records it."""
    if os.path.realpath(folder) == os.path.realpath(TOY_TARGET):
        return "`git checkout -- toy-target` restores it"
    return f"`python toy.py --out {folder}` rebuilds it after you delete the folder"


def check_toy(flag: str, folder: str, recipe: dict | None = None) -> None:
    """A toy folder against its toy.json (`recipe`; None: read from the folder): the prompt and
    answer files against their sha256, the weights and the tokenizer against the recorded
    fingerprint. A file that does not match is a UserError, never a silently different toy.
    toy.open_toy, and every folder check that meets a toy.json (check_model_folder), run it."""
    folder = os.path.abspath(folder)
    if recipe is None:
        recipe = read_json(flag, os.path.join(folder, TOY_RECIPE))
    if "files" not in recipe or "fingerprint" not in recipe:
        raise UserError(
            f"{folder} is an unfinished toy ({TOY_RECIPE} records no files): rerun "
            f"`python toy.py --out {folder}` to finish it"
        )
    restore = toy_restore(folder)
    for name in TOY_FILES.values():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise UserError(f"{path} is missing from the toy; {restore}")
        if sha256_file(path) != recipe["files"][name]:
            raise UserError(
                f"{path} does not match {os.path.join(folder, TOY_RECIPE)} (its sha256 "
                "differs): the toy's prompts and the target's answers to them belong "
                f"together; {restore}"
            )
    found = fingerprint(folder)
    recorded = recipe["fingerprint"]
    for key, what in (("weights_sha256", "weights"), ("tokenizer", "tokenizer")):
        if found[key] != recorded[key]:
            raise UserError(
                f"the toy target's {what} in {folder} do not match {TOY_RECIPE}'s fingerprint "
                f"({found[key][:16]} != {recorded[key][:16]}); {restore}"
            )


# --------------------------------------------------------------------------------------------------
# What a command writes, and what it may write over

# the text chunk every PNG this project draws carries (pictures._save): keyword and text
PICTURE_MARK = ("Software", "D3D reference implementation (systems/pictures.py)")


@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of folder or file the commands write: what a refusal calls it, whether it is a
    folder, and `mark`, a function of a path on disk that returns what shows it to be one (its
    own file, or a key of its content) or None."""

    name: str
    folder: bool
    mark: Callable[[str], str | None]


def holds(folder: str, name: str) -> str | None:
    """`name` if the folder holds a file of that name, else None."""
    if os.path.isfile(os.path.join(folder, name)):
        return name
    return None


def recorded_args(folder: str) -> dict | None:
    """The folder's train_args.json, or None where there is none or it holds no JSON object."""
    return json_object(os.path.join(folder, TRAIN_RECORD))


def json_object(path: str) -> dict | None:
    """The JSON object a file holds; None for a file that is missing or holds anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    return value


def training_run_mark(folder: str) -> str | None:
    """`python train.py`'s --out: its checkpoint (a run under way or stopped), or the
    train_args.json it ends with (one that names no drafter it was pruned from)."""
    for name in (CHECKPOINT, SHARDED_CHECKPOINT):
        if os.path.exists(os.path.join(folder, name)):
            return name
    record = recorded_args(folder)
    if record is not None and "pruned_from" not in record:
        return TRAIN_RECORD
    return None


def pruned_drafter_mark(folder: str) -> str | None:
    """`train.py prune`'s --out: its prune_table.json, or a train_args.json that names the
    drafter it was pruned from."""
    if holds(folder, PRUNE_TABLE):
        return PRUNE_TABLE
    record = recorded_args(folder)
    if record is not None and "pruned_from" in record:
        return TRAIN_RECORD
    return None


def toy_mark(folder: str) -> str | None:
    """toy.py's folder: its toy.json."""
    return holds(folder, TOY_RECIPE)


def drafter_mark(folder: str) -> str | None:
    """A D3D drafter that no run of train.py wrote (make_drafter, save_pretrained)."""
    return holds(folder, "d3d_config.json")


def model_mark(folder: str) -> str | None:
    """A model folder that save_pretrained wrote: its config.json."""
    return holds(folder, "config.json")


def png_text(path: str) -> dict:
    """The text chunks (tEXt) a PNG file holds before its pixels, {keyword: text}; {} for a
    file that is no PNG."""
    text = {}
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return text
        while True:
            head = f.read(8)
            if len(head) < 8:
                return text
            length, chunk = struct.unpack(">I4s", head)
            if chunk in (b"IDAT", b"IEND"):
                return text
            body = f.read(length)
            # the chunk's CRC
            f.read(4)
            if chunk == b"tEXt":
                keyword, _, value = body.partition(b"\0")
                text[keyword.decode("latin-1")] = value.decode("latin-1")


def picture_mark(path: str) -> str | None:
    """A picture this project drew (every --plot, python -m systems.pictures): a PNG with
    PICTURE_MARK in its text."""
    keyword, text = PICTURE_MARK
    if png_text(path).get(keyword) == text:
        return "PNG"
    return None


def pictures_mark(folder: str) -> str | None:
    """`python -m systems.pictures`'s --out: pictures this project drew, and nothing else."""
    names = sorted(os.listdir(folder))
    if not names:
        return None
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or picture_mark(path) is None:
            return None
    return f"{len(names)} PNG files"


def trace_mark(path: str) -> str | None:
    """decode.py --trace's file: a Chrome trace whose otherData names the mode it decoded."""
    trace = json_object(path)
    if trace is None or "traceEvents" not in trace:
        return None
    other = trace.get("otherData")
    if not isinstance(other, dict) or "mode" not in other:
        return None
    return "traceEvents, otherData"


def benchmark_mark(path: str) -> str | None:
    """decode.py --out's file: a benchmark's figures with the command and flags they came
    from (its env)."""
    result = json_object(path)
    if result is None:
        return None
    env = result.get("env")
    if not isinstance(env, dict) or "command" not in env or "args" not in env:
        return None
    return "env"


TRAINING_RUN = Kind("a training run of train.py", True, training_run_mark)
PRUNED_DRAFTER = Kind("a pruned drafter of train.py prune", True, pruned_drafter_mark)
MASK_PICTURES = Kind("a folder of pictures this project drew", True, pictures_mark)
PICTURE = Kind("a picture this project drew", False, picture_mark)
TRACE = Kind("a trace of decode.py --trace", False, trace_mark)
BENCHMARK = Kind("a benchmark of decode.py --out", False, benchmark_mark)
# what else a folder may be: only named in a refusal
TOY = Kind("a toy target of toy.py", True, toy_mark)
DRAFTER = Kind("a D3D drafter", True, drafter_mark)
MODEL = Kind("a model folder", True, model_mark)
# the order a path is described in: the first kind whose mark it holds (a training run also
# holds a drafter's files, and a drafter a model's)
KINDS = (TOY, PRUNED_DRAFTER, TRAINING_RUN, MASK_PICTURES, DRAFTER, MODEL)
KINDS += (PICTURE, TRACE, BENCHMARK)


def describe(path: str) -> str:
    """What a folder or file on disk holds, as a refusal names it: the first of KINDS whose
    mark it holds, and the mark; else a folder's first names or a file's size."""
    folder = os.path.isdir(path)
    for kind in KINDS:
        if kind.folder != folder:
            continue
        mark = kind.mark(path)
        if mark is not None:
            return f"{kind.name} ({mark})"
    if not folder:
        return f"another file ({os.path.getsize(path)} bytes)"
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:3])
    if len(names) > 3:
        shown += ", ..."
    return f"other files ({shown})"


def check_not_toy_target(flag: str, path: str | None) -> None:
    """A path a command writes is never the repository's toy target, nor inside it: toy-target/
    stays as toy.json records it, --force or not."""
    if not path:
        return
    shipped = os.path.realpath(TOY_TARGET)
    full = os.path.realpath(path)
    if os.path.commonpath([full, shipped]) != shipped:
        return
    where = "inside "
    if full == shipped:
        where = ""
    raise UserError(
        f"{flag} {path} is {where}the repository's toy target (toy-target/), which no command "
        f"writes — give another {flag}"
    )


def check_output(flag: str, path: str | None, kind: Kind, force: bool) -> None:
    """The one rule of what a command writes. A folder only where it is absent, empty or of the
    command's own `kind` (a run of it, known by its own files); a file only where it is absent
    or of `kind` (known by its content). Anything else only with --force (`force`); the
    repository's toy target never (check_not_toy_target). Every driver calls it while it
    checks its flags, before anything loads or is written; a refusal is one UserError naming
    the path, what it holds, and the ways out. None or "" (nothing written): no check."""
    if not path:
        return
    check_not_toy_target(flag, path)
    if not os.path.lexists(path):
        return
    is_folder = os.path.isdir(path)
    if kind.folder and not is_folder:
        raise UserError(f"{flag} {path} is a file, not a folder — give another {flag}")
    if is_folder and not kind.folder:
        raise UserError(f"{flag} {path} is a folder — give a file name")
    if is_folder and not os.listdir(path):
        return
    if kind.mark(path) is not None:
        return
    if force:
        return
    raise UserError(
        f"{flag} {path} holds {describe(path)}, not {kind.name} — give another {flag}, or add "
        "--force to write over it"
    )
