"""Bad input, tried as a user would: every number flag of both drivers and their sub-commands at
the edges of its range and just past them, every path flag at a missing file, a folder, an empty
file and a cut-short one. Past the edge: one line `error: ...`, exit status 2, `--out` untouched.
At the edge: the value is accepted as given."""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import decode
import runtime
import toy
import train
from systems import cli, decode_flags, evaluation, pruning, train_flags


def prune_entry(argv):
    return train.cli_main(["prune", *argv])


def eval_entry(argv):
    return train.cli_main(["eval", *argv])


# driver -> (entry point taking argv, its ranges, flags spelt otherwise, its parser)
DRIVERS = {
    "train.py": (train.cli_main, train.RANGES, {}),
    "train.py prune": (prune_entry, pruning.PRUNE_RANGES, {}),
    "train.py eval": (eval_entry, evaluation.EVAL_RANGES, {}),
    "decode.py": (decode.cli_main, decode_flags.RANGES, decode_flags.FLAGS),
}


def edges(allowed: cli.Range) -> tuple[list, list]:
    """(values at the edges of the range, values just past them)."""
    step = 1 if allowed.kind is int else 1e-3
    inside = []
    outside = []
    if allowed.low is not None:
        low = allowed.kind(allowed.low)
        if allowed.low_open:
            inside.append(low + step)
            outside.append(low)
        else:
            inside.append(low)
            outside.append(low - step)
    if allowed.high is not None:
        high = allowed.kind(allowed.high)
        if allowed.high_open:
            inside.append(high - step)
            outside.append(high)
        else:
            inside.append(high)
            outside.append(high + step)
    return inside, outside


def number_ranges(ranges: dict) -> dict:
    """The ranges with an edge: a number flag's (choices and bools have none)."""
    return {n: r for n, r in ranges.items() if r.low is not None or r.high is not None}


def cases():
    for driver, (_, ranges, flags) in DRIVERS.items():
        for name, allowed in number_ranges(ranges).items():
            flag = flags.get(name, cli.flag_name(name))
            yield pytest.param(driver, name, flag, allowed, id=f"{driver} {flag}")


def snapshot(folder) -> dict:
    """Every file under a folder with its sha256: what a failing run must leave as it was."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[path] = hashlib.sha256(f.read()).hexdigest()
    return found


def fails_in_one_line(entry, argv, capsys) -> str:
    """Run a driver's entry point as its __main__ does; it must exit with status 2 and print
    one line 'error: ...'. Returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run(entry, [str(a) for a in argv])
    assert exit_info.value.code == 2, "a bad input exits with status 2"
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), f"one line 'error: ...', got {err!r}"
    assert "\n" not in err, f"one line, got {err!r}"
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny HF model folder with the toy's tokenizer, a copy of it cut short, a prompts file,
    an empty file, an empty folder, a cut-short JSON Lines file, and an --out folder to keep."""
    root = tmp_path_factory.mktemp("cli")
    tok = toy.make_tokenizer()
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
    model = Qwen3ForCausalLM(config)
    for name in ("model", "cut"):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    weights = root / "cut" / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    # a drafter folder cut short: the model folder plus its d3d_config.json
    (root / "cut" / "d3d_config.json").write_text(json.dumps({"block_size": 4}))
    (root / "prompts.jsonl").write_text('{"question": "1 + 2"}\n{"question": "3 * 4"}\n')
    (root / "cut.jsonl").write_text('{"question": "1 + 2"}\n{"question": "3 *')
    (root / "empty.jsonl").write_text("")
    (root / "empty-folder").mkdir()
    out = root / "out"
    out.mkdir()
    (out / "keep.txt").write_text("a drafter folder a failing run must not touch\n")
    return root


@pytest.mark.parametrize("driver,name,flag,allowed", list(cases()))
def test_every_flag_is_refused_just_past_its_range_in_one_line(
    driver, name, flag, allowed, folders, capsys
):
    entry = DRIVERS[driver][0]
    _, outside = edges(allowed)
    out = folders / "out"
    before = snapshot(out)
    for value in outside:
        given = [value, value] if allowed.each else [value]
        argv = [flag, *given]
        if driver == "train.py prune" and name != "min_layers":
            argv += ["--min-layers", 1]
        if driver in ("train.py", "train.py prune"):
            argv += ["--out", out]
        err = fails_in_one_line(entry, argv, capsys)
        assert flag in err and allowed.describe() in err, err
    assert snapshot(out) == before, "a failing run leaves --out as it was"


@pytest.mark.parametrize("driver,name,flag,allowed", list(cases()))
def test_every_flag_takes_the_edges_of_its_range_as_given(driver, name, flag, allowed):
    inside, _ = edges(allowed)
    for value in inside:
        given = [str(value), str(value)] if allowed.each else [str(value)]
        if driver == "train.py":
            args = train.parse_args([flag, *given])
            train.check_args(args)
            train_flags.fill_defaults(args, toy_run=True)
        elif driver == "train.py prune":
            args = pruning.parse_prune_args([flag, *given])
        elif driver == "train.py eval":
            args = evaluation.parse_eval_args([flag, *given])
        else:
            args = decode.build_parser().parse_args([flag, *given])
        cli.check_ranges(vars(args), DRIVERS[driver][1], DRIVERS[driver][2])
        kept = getattr(args, name)
        expected = [allowed.kind(value)] * 2 if allowed.each else allowed.kind(value)
        assert kept == expected, f"{flag} {value} is used as given, got {kept}"


def test_decode_main_called_from_python_checks_every_flag():
    """decode.main takes the parsed flags: a value past its range set on the namespace after
    parsing is refused by the same check, in the same words, before anything loads."""
    for name, allowed in number_ranges(decode_flags.RANGES).items():
        _, outside = edges(allowed)
        args = decode.parse_args([])
        value = outside[0]
        if allowed.each:
            value = [value, value]
        setattr(args, name, value)
        flag = decode_flags.FLAGS.get(name, cli.flag_name(name))
        with pytest.raises(runtime.UserError, match=f"{flag} must be"):
            decode.main(args)


# the number flags each driver had when their flags were written out by hand: none may go
NUMBER_FLAGS = {"train.py": 23, "train.py prune": 11, "train.py eval": 2, "decode.py": 16}


def test_every_number_flag_has_a_range():
    actions = {
        "train.py": parser_actions(train.parse_args),
        "train.py prune": parser_actions(pruning.parse_prune_args),
        "train.py eval": parser_actions(evaluation.parse_eval_args),
        "decode.py": decode.build_parser()._actions,
    }
    for driver, acts in actions.items():
        ranges = DRIVERS[driver][1]
        numbers = [a for a in acts if a.type in (int, float) and a.choices is None]
        assert len(numbers) >= NUMBER_FLAGS[driver], f"{driver}: {len(numbers)} number flags"
        for action in numbers:
            assert action.dest in ranges, f"{driver} {action.option_strings[0]} has no range"


def parser_actions(parse) -> list:
    """The actions of the parser a parse function builds anew each call. argparse's own
    parse_args is wrapped and put back exactly (it is defined there, not on cli.Parser)."""
    seen = []
    real = argparse.ArgumentParser.parse_args

    def record(self, argv=None, namespace=None):
        seen.extend(self._actions)
        return real(self, argv, namespace)

    argparse.ArgumentParser.parse_args = record
    try:
        parse([])
    finally:
        argparse.ArgumentParser.parse_args = real
    assert "parse_args" not in vars(cli.Parser)
    return seen


def test_zero_is_used_where_it_means_something_and_never_replaced():
    args = train.parse_args(["--seed", "0", "--warmup", "0", "--ar-weight", "0"])
    train.check_args(args)
    train_flags.fill_defaults(args, toy_run=True)
    assert (args.seed, args.warmup, args.ar_weight) == (0, 0, 0.0)
    args = train.parse_args([])
    train_flags.fill_defaults(args, toy_run=True)
    assert (args.block_size, args.num_anchors, args.lr) == (8, 32, 6e-3)
    args = train.parse_args([])
    train_flags.fill_defaults(args, toy_run=False)
    assert (args.block_size, args.num_anchors, args.lr) == (16, 64, 1e-3)
    args = train.parse_args(["--block-size", "3", "--num-anchors", "2", "--lr", "0.5"])
    train_flags.fill_defaults(args, toy_run=True)
    assert (args.block_size, args.num_anchors, args.lr) == (3, 2, 0.5)
    args = decode.build_parser().parse_args(["--coverage", "0", "--temperature", "0"])
    cli.check_ranges(vars(args), decode_flags.RANGES, decode_flags.FLAGS)
    assert (args.coverage, args.temperature) == (0, 0.0)


def path_cases(root):
    """(what, path) for each way a path can be wrong."""
    return {
        "missing file": root / "no-such.jsonl",
        "folder": root / "empty-folder",
        "empty file": root / "empty.jsonl",
        "cut-short file": root / "cut.jsonl",
    }


def folder_cases(root):
    return {
        "missing folder": root / "no-such-folder",
        "file": root / "prompts.jsonl",
        "empty folder": root / "empty-folder",
        "cut-short folder": root / "cut",
    }


FILE_FLAGS = [
    ("train.py", "--prompts", ["--target", "{model}"]),
    ("train.py", "--val-prompts", ["--target", "{model}", "--prompts", "{prompts}"]),
    ("decode.py", "--prompts-file", []),
    ("decode.py", "--bench", []),
    ("decode.py", "--prefill-bench", []),
]
FOLDER_FLAGS = [
    ("train.py", "--target", ["--prompts", "{prompts}"]),
    ("train.py", "--drafter-init", ["--target", "{model}", "--prompts", "{prompts}"]),
    ("train.py prune", "--drafter", ["--min-layers", "1"]),
    ("train.py eval", "--drafter", []),
    ("decode.py", "--drafter", ["--prompt", "hi"]),
    ("decode.py", "--target", ["--prompt", "hi"]),
]


def fill(argv, root):
    names = {"{model}": root / "model", "{prompts}": root / "prompts.jsonl"}
    return [names.get(a, a) for a in argv]


@pytest.mark.parametrize(
    "driver,flag,extra", FILE_FLAGS, ids=[f"{d} {f}" for d, f, _ in FILE_FLAGS]
)
def test_every_file_flag_names_the_file_in_one_line(driver, flag, extra, folders, capsys):
    entry = DRIVERS[driver][0]
    out = folders / "out"
    before = snapshot(out)
    for what, path in path_cases(folders).items():
        if what == "cut-short file" and flag == "--prefill-bench":
            continue  # its prompts are joined into long prompts after the models load
        argv = [flag, path, *fill(extra, folders)]
        if driver == "train.py":
            argv += ["--out", out, "--max-new-tokens", 4]
        err = fails_in_one_line(entry, argv, capsys)
        assert str(path) in err, f"{what}: the error names {path}: {err}"
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "driver,flag,extra", FOLDER_FLAGS, ids=[f"{d} {f}" for d, f, _ in FOLDER_FLAGS]
)
def test_every_folder_flag_names_the_folder_in_one_line(driver, flag, extra, folders, capsys):
    entry = DRIVERS[driver][0]
    out = folders / "out"
    before = snapshot(out)
    for what, path in folder_cases(folders).items():
        argv = [flag, path, *fill(extra, folders)]
        if driver in ("train.py", "train.py prune"):
            argv += ["--out", out]
        err = fails_in_one_line(entry, argv, capsys)
        assert str(path) in err, f"{what}: the error names {path}: {err}"
        if what == "cut-short folder":
            assert "cut short" in err, err
    assert snapshot(out) == before


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    def broken(argv):
        raise KeyError("a bug, not bad input")

    with pytest.raises(KeyError):
        cli.run(broken, [])


def test_a_value_error_from_the_method_is_not_swallowed():
    def bad_dtype():
        return runtime.resolve_dtype("float8", torch.device("cpu"))

    with pytest.raises(ValueError):
        cli.run(bad_dtype)


def test_a_recorded_path_that_is_gone_is_named(folders, tmp_path, capsys):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    for name in os.listdir(folders / "model"):
        (drafter / name).write_bytes((folders / "model" / name).read_bytes())
    (drafter / "d3d_config.json").write_text(json.dumps({"block_size": 4}))
    recipe = {
        "target": str(folders / "model"),
        "prompts": "gone/prompts.jsonl",
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
    err = fails_in_one_line(eval_entry, ["--drafter", drafter], capsys)
    assert "gone/prompts.jsonl is gone" in err, err


def test_a_damaged_toy_is_named_in_one_line(tmp_path, capsys):
    broken = tmp_path / "toy"
    broken.mkdir()
    (broken / "toy.json").write_text("{not json")
    err = fails_in_one_line(train.cli_main, ["--toy", broken, "--out", tmp_path / "out"], capsys)
    assert "toy.json is not valid JSON" in err, err
    err = fails_in_one_line(train.cli_main, ["--toy", tmp_path / "nowhere"], capsys)
    assert "no toy at" in err and "python toy.py" in err, err
