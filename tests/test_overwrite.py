"""No command writes over what it did not make, and every folder is what it claims.

Every command that writes (train.py, train.py prune, train.py eval --plot, decode.py --out /
--trace / --plot, python -m systems.pictures) is given, for each path it writes, a model folder,
a folder of a user's other files, a run of another command, a user's file and the repository's
toy target: each is refused in one line, exit status 2, before any model loads, and every byte
there is left as it was. A folder of the command's own kind, an empty one, or --force is taken
(the toy target never). A toy target whose files differ from its toy.json is refused by every
command that reads it, and a drafter folder that holds only a stopped run is named as one.

Run: python -m pytest -q tests/test_overwrite.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib

import pytest
import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

import d3d
import decode
import runtime
import toy
import train
from systems import cli, distributed, pictures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a picture this project drew, tracked in the repository
SHIPPED_PICTURE = os.path.join(ROOT, "pictures", "training-mask.png")


def tiny_model(tok) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=(len(tok) // 16 + 1) * 16,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def png(width: int = 2, height: int = 2) -> bytes:
    """A PNG of the user's own: grey pixels, no text chunk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = b"".join(b"\0" + b"\x80" * width for _ in range(height))
    signature = b"\x89PNG\r\n\x1a\n"
    return (
        signature
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    """Every kind of path a command may be pointed at: a model folder, two D3D drafters that
    train.py wrote (training runs), a pruned drafter, a folder of a user's files, a folder of
    pictures this project drew, and files: a user's text, a user's PNG, a picture of ours, a
    trace and a benchmark of decode.py; and a prompts file for decode.py --bench."""
    root = tmp_path_factory.mktemp("overwrite")
    tok = toy.make_tokenizer()
    model = tiny_model(tok)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    drafter = d3d.make_drafter(tiny_model(tok), tokenizer=tok, block_size=4)
    for name in ("run", "pruned"):
        drafter.save_pretrained(str(root / name), tokenizer=tok)
    (root / "run" / "train_args.json").write_text(json.dumps({"target": str(root / "model")}))
    shutil.copytree(root / "run", root / "another-run")
    pruned_record = {"target": str(root / "model"), "pruned_from": str(root / "run")}
    (root / "pruned" / "train_args.json").write_text(json.dumps(pruned_record))
    (root / "pruned" / "prune_table.json").write_text(json.dumps({"table": []}))
    (root / "user").mkdir()
    (root / "user" / "notes.txt").write_text("my notes\n")
    (root / "user" / "data.csv").write_text("a,b\n1,2\n")
    (root / "drawn").mkdir()
    shutil.copy(SHIPPED_PICTURE, root / "drawn" / "mask.png")
    (root / "notes.txt").write_text("a file of the user's\n")
    (root / "photo.png").write_bytes(png())
    shutil.copy(SHIPPED_PICTURE, root / "picture.png")
    trace = {"traceEvents": [], "otherData": {"mode": "sync"}}
    (root / "trace.json").write_text(json.dumps(trace))
    bench = {"table": "", "env": {"command": None, "args": {}}}
    (root / "bench.json").write_text(json.dumps(bench))
    (root / "prompts.jsonl").write_text('{"question": "1 + 2"}\n')
    return {name: str(root / name) for name in os.listdir(root)}


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model that loads, and any picture drawn, fails the test: a refusal comes before
    (and a command that fails to refuse writes nothing)."""

    def load(*args, **kwargs):
        raise AssertionError("a model loaded or a picture was drawn before the refusal")

    monkeypatch.setattr(runtime, "load_causal_lm", load)
    monkeypatch.setattr(d3d.Drafter, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(pictures, "_save", load)


def snapshot(path: str) -> dict:
    """Every file at or under `path`, with its sha256 ({} where nothing is)."""
    found = {}
    if os.path.isfile(path):
        with open(path, "rb") as f:
            found[path] = hashlib.sha256(f.read()).hexdigest()
    for folder, _, files in os.walk(path):
        for name in files:
            file = os.path.join(folder, name)
            with open(file, "rb") as f:
                found[file] = hashlib.sha256(f.read()).hexdigest()
    return found


def refused(entry, argv, capsys) -> str:
    """Run a command's entry point as its __main__ does: exit status 2 and one line
    'error: ...'. Returns the line."""
    argv = [str(a) for a in argv]
    if entry is pictures_entry:
        assert entry(argv) == 2
    else:
        with pytest.raises(SystemExit) as exit_info:
            cli.run(entry, argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def train_entry(argv):
    return train.cli_main(argv)


def prune_entry(argv):
    return train.cli_main(["prune", "--min-layers", "1", *argv])


def eval_entry(argv):
    return train.cli_main(["eval", *argv])


def pictures_entry(argv):
    """`python -m systems.pictures masks ...`: its exit status."""
    return pictures.cli(["masks", *argv])


# command -> (its entry point, the flags every call of it here takes: {name} is paths[name])
COMMANDS = {
    "train.py": (train_entry, []),
    "train.py prune": (prune_entry, ["--drafter", "{run}"]),
    "train.py eval": (eval_entry, ["--drafter", "{run}"]),
    "decode.py": (decode.cli_main, []),
    "decode.py --bench": (decode.cli_main, ["--bench", "{prompts.jsonl}"]),
    "pictures": (pictures_entry, []),
}


def command_argv(command: str, paths: dict, *more) -> tuple:
    """(the command's entry point, its fixed flags and `more`)."""
    entry, fixed = COMMANDS[command]
    argv = []
    for word in fixed:
        if word.startswith("{"):
            word = paths[word[1:-1]]
        argv.append(word)
    return entry, [*argv, *more]


# (command, flag, the path given, the words the refusal names what is there with)
FOLDERS = [
    ("train.py", "--out", "model", "a model folder (config.json)"),
    ("train.py", "--out", "user", "other files (data.csv, notes.txt)"),
    ("train.py", "--out", "pruned", "a pruned drafter of train.py prune (prune_table.json)"),
    ("train.py", "--out", "drawn", "a folder of pictures this project drew"),
    ("train.py prune", "--out", "model", "a model folder (config.json)"),
    ("train.py prune", "--out", "user", "other files (data.csv, notes.txt)"),
    ("train.py prune", "--out", "another-run", "a training run of train.py (train_args.json)"),
    ("pictures", "--out", "model", "a model folder (config.json)"),
    ("pictures", "--out", "user", "other files (data.csv, notes.txt)"),
    ("pictures", "--out", "run", "a training run of train.py (train_args.json)"),
]
FILES = [
    ("train.py", "--plot", "notes.txt", "another file (21 bytes)"),
    ("train.py", "--plot", "photo.png", "another file"),
    ("train.py", "--plot", "trace.json", "a trace of decode.py --trace"),
    ("train.py prune", "--plot", "notes.txt", "another file (21 bytes)"),
    ("train.py prune", "--plot", "photo.png", "another file"),
    ("train.py eval", "--plot", "notes.txt", "another file (21 bytes)"),
    ("train.py eval", "--plot", "bench.json", "a benchmark of decode.py --out"),
    ("decode.py --bench", "--out", "notes.txt", "another file (21 bytes)"),
    ("decode.py --bench", "--out", "trace.json", "a trace of decode.py --trace"),
    ("decode.py", "--trace", "notes.txt", "another file (21 bytes)"),
    ("decode.py", "--trace", "bench.json", "a benchmark of decode.py --out"),
    ("decode.py", "--plot", "photo.png", "another file"),
    ("decode.py", "--plot", "trace.json", "a trace of decode.py --trace"),
    ("pictures", "--training-png", "photo.png", "another file"),
    ("pictures", "--branch-png", "notes.txt", "another file (21 bytes)"),
    ("pictures", "--branch-png", "bench.json", "a benchmark of decode.py --out"),
]
# every path each command writes, as the toy target (or a file in it) refuses it
TOY_CASES = [
    ("train.py", "--out", ""),
    ("train.py", "--plot", "acc.png"),
    ("train.py", "--data-dir", ""),
    ("train.py prune", "--out", ""),
    ("train.py prune", "--plot", "curve.png"),
    ("train.py eval", "--plot", "acc.png"),
    ("decode.py --bench", "--out", "bench.json"),
    ("decode.py", "--trace", "trace.json"),
    ("decode.py", "--plot", "acceptance.png"),
    ("pictures", "--out", ""),
    ("pictures", "--training-png", "mask.png"),
    ("pictures", "--branch-png", "config.json"),
]


@pytest.fixture
def commands(paths, tmp_path, monkeypatch, nothing_loads):
    """`paths`, with the commands run in an empty folder (their default outputs absent), no
    model allowed to load and no picture to be drawn."""
    monkeypatch.chdir(tmp_path)
    return paths


@pytest.mark.parametrize(
    "command,flag,name,held", FOLDERS, ids=[f"{c} {f} {n}" for c, f, n, _ in FOLDERS]
)
def test_a_folder_of_another_kind_is_refused_before_anything_loads(
    commands, command, flag, name, held, capsys
):
    path = commands[name]
    before = snapshot(path)
    entry, argv = command_argv(command, commands, flag, path)
    err = refused(entry, argv, capsys)
    assert f"{flag} {path} holds {held}" in err, err
    assert f"give another {flag}, or add --force" in err, err
    assert snapshot(path) == before


@pytest.mark.parametrize(
    "command,flag,name,held", FILES, ids=[f"{c} {f} {n}" for c, f, n, _ in FILES]
)
def test_a_file_of_another_kind_is_refused_before_anything_loads(
    commands, command, flag, name, held, capsys
):
    pytest.importorskip("matplotlib")
    path = commands[name]
    before = snapshot(path)
    entry, argv = command_argv(command, commands, flag, path)
    err = refused(entry, argv, capsys)
    assert f"{flag} {path} holds {held}" in err, err
    assert f"give another {flag}, or add --force" in err, err
    assert snapshot(path) == before


@pytest.mark.parametrize(
    "command,flag,inside", TOY_CASES, ids=[f"{c} {f} {i}" for c, f, i in TOY_CASES]
)
def test_the_shipped_toy_target_is_written_by_no_command_even_with_force(
    commands, command, flag, inside, capsys
):
    pytest.importorskip("matplotlib")
    path = os.path.join(toy.SHIPPED, inside) if inside else toy.SHIPPED
    before = snapshot(toy.SHIPPED)
    entry, argv = command_argv(command, commands, flag, path)
    for force in ([], ["--force"]):
        err = refused(entry, [*argv, *force], capsys)
        assert f"{flag} {path} is " in err and "the repository's toy target" in err, err
        assert "no command writes" in err and "--force" not in err, err
    assert snapshot(toy.SHIPPED) == before


def test_train_py_on_a_copy_of_the_toy_target_refuses_and_keeps_every_byte(
    commands, tmp_path, capsys
):
    """`python train.py --out COPY` where COPY is the toy target's folder (a model a user
    keeps): one line that names what is there, and the model as it was."""
    copy = tmp_path / "my-model"
    shutil.copytree(toy.SHIPPED, copy)
    before = snapshot(str(copy))
    err = refused(train_entry, ["--out", copy, "--steps", 5], capsys)
    assert f"--out {copy} holds a toy target of toy.py (toy.json)" in err, err
    assert snapshot(str(copy)) == before


# ---------------------------------------------------------------------------------------------
# What the rule takes


def test_a_path_of_the_commands_own_kind_an_empty_folder_or_none_is_taken(paths, tmp_path):
    taken = [
        ("--out", paths["run"], cli.TRAINING_RUN),
        ("--out", paths["pruned"], cli.PRUNED_DRAFTER),
        ("--out", paths["drawn"], cli.MASK_PICTURES),
        ("--plot", paths["picture.png"], cli.PICTURE),
        ("--trace", paths["trace.json"], cli.TRACE),
        ("--out", paths["bench.json"], cli.BENCHMARK),
        ("--out", str(tmp_path / "new"), cli.TRAINING_RUN),
        ("--out", str(tmp_path / "new.json"), cli.BENCHMARK),
        ("--out", "", cli.BENCHMARK),
        ("--out", None, cli.TRAINING_RUN),
    ]
    (tmp_path / "empty").mkdir()
    taken.append(("--out", str(tmp_path / "empty"), cli.PRUNED_DRAFTER))
    for flag, path, kind in taken:
        cli.check_output(flag, path, kind, force=False)


def test_force_takes_any_folder_or_file_but_the_toy_target(paths):
    for name in ("model", "user", "pruned"):
        cli.check_output("--out", paths[name], cli.TRAINING_RUN, force=True)
    for name in ("notes.txt", "photo.png", "bench.json"):
        cli.check_output("--trace", paths[name], cli.TRACE, force=True)
    with pytest.raises(runtime.UserError, match="a file, not a folder"):
        cli.check_output("--out", paths["notes.txt"], cli.TRAINING_RUN, force=True)
    with pytest.raises(runtime.UserError, match="is a folder — give a file name"):
        cli.check_output("--plot", paths["user"], cli.PICTURE, force=True)
    with pytest.raises(runtime.UserError, match="no command writes"):
        cli.check_output("--out", toy.SHIPPED, cli.TRAINING_RUN, force=True)


def test_what_the_commands_write_is_known_as_theirs(paths, tmp_path):
    """The marks are those of what the commands write: a picture drawn by pictures.py (and the
    repository's pictures), a checkpoint of train.py, the record train.py ends with."""
    pytest.importorskip("matplotlib")
    drawn = pictures.draw_block_accuracy(str(tmp_path / "acc.png"), [0.9, 0.5])
    assert cli.picture_mark(drawn) is not None
    # LAB's "Redraw the pictures" writes over the tracked ones: they carry the same mark
    tracked = os.listdir(os.path.join(ROOT, "pictures"))
    for name in tracked:
        assert cli.picture_mark(os.path.join(ROOT, "pictures", name)) is not None, name
    assert cli.picture_mark(paths["photo.png"]) is None
    run = tmp_path / "run"
    save_stopped_run(str(run), step=3)
    assert cli.training_run_mark(str(run)) == cli.CHECKPOINT
    assert cli.training_run_mark(paths["run"]) == "train_args.json"
    assert cli.training_run_mark(paths["pruned"]) is None
    assert cli.pruned_drafter_mark(paths["run"]) is None


def test_pictures_masks_redraws_its_own_folder_and_with_force_a_users(paths, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "masks"
    small = ["--block-size", "2", "--num-anchors", "1"]
    for _ in range(2):
        assert pictures.cli(["masks", *small, "--out", str(out)]) == 0
    user = tmp_path / "user"
    shutil.copytree(paths["user"], user)
    before = snapshot(str(user))
    assert pictures.cli(["masks", *small, "--out", str(user)]) == 2
    assert pictures.cli(["masks", *small, "--out", str(user), "--force"]) == 0
    after = snapshot(str(user))
    assert {k: v for k, v in after.items() if k in before} == before and len(after) == 4
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# Every folder is what it claims


def save_stopped_run(out: str, step: int) -> None:
    """What train.py leaves in --out when a signal stops it at `step`: its checkpoint pieces
    (distributed.save_checkpoint), no drafter yet."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = {"scheduler": {}, "skipped": 0, "recipe": {}, "model": model.state_dict()}
    distributed.save_checkpoint(out, step, state, optimizer.state_dict())


def test_a_stopped_run_is_named_by_every_command_that_reads_a_drafter(commands, tmp_path, capsys):
    stopped = tmp_path / "stopped"
    save_stopped_run(str(stopped), step=3)
    sharded = tmp_path / "sharded"
    (sharded / cli.SHARDED_CHECKPOINT).mkdir(parents=True)
    torch.save({"step": 7, "world": 2}, sharded / cli.SHARDED_CHECKPOINT / "train_state.pt")
    model_flags = ["--target", commands["model"], "--prompts", commands["prompts.jsonl"]]
    readers = {
        "decode.py": (decode.cli_main, ["--prompt", "hi", "--drafter"]),
        "train.py eval": (eval_entry, ["--drafter"]),
        "train.py prune": (prune_entry, ["--drafter"]),
        "train.py --drafter-init": (train_entry, [*model_flags, "--drafter-init"]),
    }
    for folder, step, command in ((stopped, 3, "python train.py"), (sharded, 7, "torchrun")):
        before = snapshot(str(folder))
        for name, (entry, argv) in readers.items():
            err = refused(entry, [*argv, folder], capsys)
            assert f"{folder} holds an unfinished training run, stopped at step {step}" in err
            assert f"finish it with `{command}" in err and f"--out {folder}`" in err, err
            assert "not a D3D drafter" not in err, (name, err)
        assert snapshot(str(folder)) == before


@pytest.fixture
def changed_toy(tmp_path) -> str:
    """A copy of the toy target whose weights are no longer those its toy.json records (as
    after a drafter was saved over it): one byte of a weight flipped."""
    folder = tmp_path / "toy"
    shutil.copytree(toy.SHIPPED, folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    return str(folder)


def test_every_command_that_reads_a_toy_target_checks_its_fingerprint(
    commands, changed_toy, tmp_path, capsys
):
    """decode.py (--target, or the target a drafter records), train.py eval and prune (the
    target a drafter records) refuse a toy target whose weights differ from its toy.json, in
    train.py's own words, before any model loads."""
    drafter = tmp_path / "drafter"
    shutil.copytree(commands["run"], drafter)
    recipe = {
        "target": changed_toy,
        "prompts": os.path.join(changed_toy, "prompts-train.jsonl"),
        "prompt_field": "question",
        "thinking": False,
        "max_new_tokens": 4,
        "gen_batch_size": 2,
        "num_prompts": None,
        "num_val": 2,
        "max_len": 64,
        "val_anchors": 4,
        "val_fraction": 0.5,
    }
    (drafter / "train_args.json").write_text(json.dumps(recipe))
    runs = [
        (decode.cli_main, ["--target", changed_toy, "--drafter", drafter, "--prompt", "1 + 2"]),
        (decode.cli_main, ["--drafter", drafter, "--prompt", "1 + 2"]),
        (eval_entry, ["--drafter", drafter]),
        (prune_entry, ["--drafter", drafter, "--out", tmp_path / "pruned"]),
        (train_entry, ["--toy", changed_toy, "--out", tmp_path / "out"]),
    ]
    for entry, argv in runs:
        err = refused(entry, argv, capsys)
        assert f"the toy target's weights in {changed_toy} do not match toy.json's" in err, err
        assert f"`python toy.py --out {changed_toy}` rebuilds it" in err, err
    assert not os.path.exists(tmp_path / "pruned") and not os.path.exists(tmp_path / "out")


def test_the_shipped_toy_target_is_told_to_be_restored_by_git(monkeypatch, changed_toy):
    """The same check on the repository's own toy says how to get it back: git."""
    monkeypatch.setattr(cli, "TOY_TARGET", changed_toy)
    with pytest.raises(runtime.UserError, match="`git checkout -- toy-target` restores it"):
        cli.check_model_folder("--target", changed_toy)
