"""Bad input, tried as a user would: every number flag of both drivers and their sub-commands at
the edges of its range and just past them, every path flag at a missing file, a folder, an empty
file and a cut-short one. Past the edge: one line `error: ...`, exit status 2, `--out` untouched.
At the edge: the value is accepted as given."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import operator
import os
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import d3d
import decode
import runtime
import toy
import train
from systems import cli, decode_flags, distributed, evaluation, pruning, train_flags


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


# --------------------------------------------------------------------------------------------------
# The documented contract, written out by hand: every flag of every driver and every field of the
# method's configs, with its range or choices in words and its default, as --help and the
# configs' docs state them. Nothing here is read from the Range objects the code checks with:
# each value is probed through the driver (parsed and checked up to where the run loads its
# models) or the config, at every edge of its rule and on both sides of it.


@dataclasses.dataclass(frozen=True)
class Row:
    """One flag or field. kind: int, float, str, or SWITCH (a flag without a value). rule: "any",
    words such as "x >= 1", "0 < x <= 1", "each x >= 1" (every value of a list), or a tuple of
    the choices. default: what a run gets without the flag; toy: train.py's default on the toy
    where it is another. needs: the flags a value goes with (a --concurrency goes with --bench).
    accepts, refuses: values to probe besides the rule's edges."""

    kind: object
    rule: object = "any"
    default: object = None
    toy: object = None
    needs: tuple = ()
    accepts: tuple = ()
    refuses: tuple = ()


SWITCH = "switch"
# the folder train.py and decode.py are in
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = ("auto", "float32", "bfloat16")
TRAIN_FLAGS = {
    # data
    "--target": Row(str),
    "--toy": Row(str, default=os.path.join(REPOSITORY, "toy-target")),
    "--prompts": Row(str),
    "--prompt-field": Row(str, default="question"),
    "--val-prompts": Row(str),
    "--val-fraction": Row(float, "0 < x < 1", 0.05),
    "--num-prompts": Row(int, "x >= 1"),
    "--num-val": Row(int, "x >= 1", 200),
    "--thinking": Row(SWITCH, default=False),
    "--max-new-tokens": Row(int, "x >= 1", 256),
    "--gen-batch-size": Row(int, "x >= 1", 64),
    "--data-dir": Row(str),
    # drafter
    "--drafter-init": Row(str),
    "--drafter-layers": Row(str, accepts=("2", "0,1"), refuses=("",)),
    "--random-init": Row(SWITCH, default=False),
    # the method
    "--block-size": Row(int, "x >= 1", 16, toy=8),
    "--num-anchors": Row(int, "x >= 1", 64, toy=32),
    "--ar-weight": Row(float, "x >= 0", 1.0),
    "--decay-gamma": Row(float, "x > 0"),
    "--d1-from": Row(str, ("causal", "mask"), "causal"),
    # training
    "--out": Row(str, default="runs/toy/drafter"),
    "--steps": Row(int, "x >= 1", 400),
    "--batch-size": Row(int, "x >= 1", 8),
    "--grad-accum": Row(int, "x >= 1", 1),
    "--lr": Row(float, "x > 0", 1e-3, toy=6e-3),
    "--warmup": Row(int, "x >= 0", 20),
    "--weight-decay": Row(float, "x >= 0", 0.0),
    "--grad-clip": Row(float, "x > 0", 1.0),
    "--freeze-embeddings": Row(SWITCH, default=False),
    # a sequence holds a prompt token and a response token at least
    "--max-len": Row(int, "x >= 2", 1024),
    "--eval-every": Row(int, "x >= 1", 100),
    "--val-anchors": Row(int, "x >= 1", 32),
    "--save-every": Row(int, "x >= 1", 100),
    "--seed": Row(int, "x >= 0", 0),
    "--no-resume": Row(SWITCH, default=True),
    "--fsdp": Row(SWITCH, default=False),
    # run
    "--dtype": Row(str, DTYPES, "auto"),
    "--gradient-checkpointing": Row(SWITCH, default=False),
    "--dist-timeout": Row(float, "x > 0", 60.0),
    "--plot": Row(str),
    "--threads": Row(int, "x >= 1", None, toy=1),
    "--device": Row(str),
    "--force": Row(SWITCH, default=False),
    # a flag added to train.py gets its row here (test_the_table_names_every_flag fails until
    # it has one)
}
PRUNE_FLAGS = {
    "--drafter": Row(str, default="runs/toy/drafter"),
    "--device": Row(str),
    "--min-layers": Row(int, "x >= 1"),
    # a floor above the unpruned tau would stop before any removal
    "--tau-floor": Row(float, "0 < x <= 1"),
    "--recovery-steps": Row(int, "x >= 0", 50),
    # prune's own defaults, not training's nor d3d.PruneConfig's
    "--lr": Row(float, "x > 0", 1e-4),
    "--beta": Row(float, "0 <= x <= 1", 0.5),
    "--val-anchors": Row(int, "x >= 1", 16),
    "--seed": Row(int, "x >= 0", 0),
    "--out": Row(str),
    "--batch-size": Row(int, "x >= 1", 8),
    "--num-val": Row(int, "x >= 1", 64),
    "--compare-prompts": Row(int, "x >= 0", 8),
    "--max-new-tokens": Row(int, "x >= 1", 128),
    "--dtype": Row(str, DTYPES),
    "--gradient-checkpointing": Row(SWITCH),
    "--no-gradient-checkpointing": Row(SWITCH),
    "--plot": Row(str),
    "--force": Row(SWITCH, default=False),
}
EVAL_FLAGS = {
    "--drafter": Row(str, default="runs/toy/drafter"),
    "--device": Row(str),
    "--num-val": Row(int, "x >= 1"),
    "--val-anchors": Row(int, "x >= 1"),
    "--dtype": Row(str, DTYPES),
    "--plot": Row(str),
    "--force": Row(SWITCH, default=False),
}
DECODE_FLAGS = {
    # models
    "--target": Row(str),
    "--drafter": Row(str, default="runs/toy/drafter"),
    "--device": Row(str),
    "--dtype": Row(str, DTYPES, "auto"),
    "--attn": Row(str, ("sdpa", "eager"), "sdpa"),
    "--threads": Row(int, "x >= 1"),
    # prompts
    "--prompt": Row(str),
    "--prompts-file": Row(str),
    "--prompt-field": Row(str),
    "--max-samples": Row(int, "x >= 1"),
    "--thinking": Row(SWITCH, default=False),
    # decoding: an answer of no tokens has no speed; F = 0 branches nothing
    "--max-new-tokens": Row(int, "x >= 1", 128),
    "--temperature": Row(float, "x >= 0", 0.0),
    "--block-size": Row(int, "x >= 1"),
    "--coverage": Row(int, "x >= 0"),
    "--fanout": Row(int, "x >= 1"),
    "--cover": Row(str, ("first", "likely"), "first"),
    "--lanes": Row(int, (1, 2)),
    "--keep-ratio": Row(float, "0 < x <= 1"),
    "--chunk-size": Row(int, "x >= 1", 64),
    # the run
    "--mode": Row(
        str,
        accepts=("target", "sync", "async", "async:2,1", "sync+compiled"),
        refuses=("fast", "async:2"),
    ),
    "--compile": Row(str, ("whole", "regional")),
    "--trace": Row(str),
    "--max-len": Row(int, "x >= 1"),
    "--seed": Row(int, "x >= 0", 0),
    "--sampling-check": Row(int, "x >= 2", needs=("--temperature", "1")),
    # benchmark
    "--bench": Row(str),
    "--modes": Row(
        str,
        needs=("--bench", "{prompts}"),
        accepts=("sync", "async:0,2", "async:12,2,likely", "hf"),
        refuses=("fast", "target+fast"),
    ),
    "--tie-tolerance": Row(float, "x >= 0"),
    "--concurrency": Row(int, "each x >= 1", needs=("--bench", "{prompts}")),
    "--out": Row(str, default="runs/bench.json"),
    # selective prefilling benchmark
    "--prefill-bench": Row(str),
    "--keep-ratios": Row(float, "each 0 < x <= 1", (1.0, 0.3, 0.2, 0.1)),
    "--num-docs": Row(int, "x >= 1", 12),
    # output
    "--explain": Row(SWITCH, default=False),
    "--plot": Row(str),
    "--no-color": Row(SWITCH, default=False),
    "--force": Row(SWITCH, default=False),
    # a flag added to decode.py gets its row here
}
# the configs a user builds from Python: field -> Row (SWITCH: a bool)
D3D_CONFIG = {
    "block_size": Row(int, "x >= 1", 16),
    "mask_token_id": Row(int, default=-1),
    "num_anchors": Row(int, "x >= 1", 64),
    "ar_weight": Row(float, "x >= 0", 1.0),
    "decay_gamma": Row(float, "x > 0"),
    "target_vocab_size": Row(int, default=0),
    "tokenizer_hash": Row(str, default=""),
    "layer_ids": Row(list),
    "d1_from": Row(str, ("causal", "mask"), "causal"),
}
DECODE_CONFIG = {
    # generate(..., max_new_tokens=0) returns the prompt; fanout=0 is async:C,0, no branches
    "max_new_tokens": Row(int, "x >= 0", 128),
    "mode": Row(str, ("target", "sync", "async"), "sync"),
    "temperature": Row(float, "x >= 0", 0.0),
    "eos_token_id": Row(int, "each x >= 0", accepts=([3, 4], (3, 4)), refuses=([3, -1], (-1,))),
    "block_size": Row(int, "x >= 1"),
    "coverage": Row(int, "x >= 0"),
    "fanout": Row(int, "x >= 0"),
    "cover": Row(str, ("first", "likely"), "first"),
    "lanes": Row(int, (1, 2)),
    "keep_ratio": Row(float, "0 < x <= 1"),
    "chunk_size": Row(int, "x >= 1", 64),
    "trace": Row(SWITCH, default=False),
}
PRUNE_CONFIG = {
    "min_layers": Row(int, "x >= 1"),
    "tau_floor": Row(float, "x > 0"),
    "recovery_steps": Row(int, "x >= 0", 100),
    "lr": Row(float, "x > 0", 5e-5),
    "beta": Row(float, "0 <= x <= 1", 0.5),
    "val_anchors": Row(int, "x >= 1", 32),
    "seed": Row(int, "x >= 0", 0),
    "checkpointing": Row(SWITCH, default=False),
}
TABLE = {
    "train.py": TRAIN_FLAGS,
    "train.py prune": PRUNE_FLAGS,
    "train.py eval": EVAL_FLAGS,
    "decode.py": DECODE_FLAGS,
    "d3d.D3DConfig": D3D_CONFIG,
    "d3d.DecodeConfig": DECODE_CONFIG,
    "d3d.PruneConfig": PRUNE_CONFIG,
}
CONFIGS = {
    "d3d.D3DConfig": d3d.D3DConfig,
    "d3d.DecodeConfig": d3d.DecodeConfig,
    "d3d.PruneConfig": d3d.PruneConfig,
}
# the comparisons a rule's words use
COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
# the same comparison with its sides swapped: "0 < x" is "x > 0"
SWAPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def conditions(rule: str) -> tuple[bool, list]:
    """(whether the rule holds for each value of a list, [(comparison, bound)]) of a rule's
    words: "x >= 1" -> (False, [(">=", 1)]); "each 0 < x <= 1" -> (True, [(">", 0), ("<=", 1)])."""
    each = rule.startswith("each ")
    words = rule.removeprefix("each ").split()
    found = []
    x = words.index("x")
    if x == 2:
        found.append((SWAPPED[words[1]], float(words[0])))
    if len(words) > x + 1:
        found.append((words[x + 1], float(words[x + 2])))
    return each, found


def holds(value, rule: str) -> bool:
    """Whether a number is inside a rule's words."""
    _, found = conditions(rule)
    return all(COMPARE[comparison](value, bound) for comparison, bound in found)


def probes(row: Row) -> list[tuple[object, bool]]:
    """(value, whether the contract takes it) to try: a number at each bound of its rule and on
    both sides of it (one apart for an int, 0.001 for a float), an int flag's 1.5, every choice
    and one past them, and the row's own values. A rule for each value of a list: each number
    comes second in a list, after one the rule takes."""
    found = [(value, True) for value in row.accepts]
    found += [(value, False) for value in row.refuses]
    if isinstance(row.rule, tuple):
        found += [(choice, True) for choice in row.rule]
        if row.kind is int:
            found += [(min(row.rule) - 1, False), (max(row.rule) + 1, False)]
        else:
            found.append(("none-of-these", False))
        return found
    if row.rule == "any":
        return found
    each, bounds = conditions(row.rule)
    step = 1 if row.kind is int else 1e-3
    numbers = []
    for _, bound in bounds:
        for value in (bound - step, bound, bound + step):
            numbers.append((row.kind(round(value, 6)), holds(value, row.rule)))
    if row.kind is int:
        numbers.append(("1.5", False))
    if each:
        taken = next(value for value, inside in numbers if inside)
        numbers = [([taken, value], inside) for value, inside in numbers]
    return found + numbers


def cells():
    for where, rows in TABLE.items():
        for name, row in rows.items():
            yield pytest.param(where, name, row, id=f"{where} {name}")


class Reached(Exception):
    """The run got past its checks: it would load its models now."""


def reached(*args, **kwargs):
    raise Reached


@pytest.fixture
def drafter_folder(folders, tmp_path):
    """A folder `train.py prune` and `eval` check as a drafter: an HF model and its
    d3d_config.json."""
    shutil.copytree(folders / "model", tmp_path / "drafter")
    (tmp_path / "drafter" / "d3d_config.json").write_text(json.dumps({"block_size": 4}))
    return tmp_path / "drafter"


def run_until_loading(where: str, argv: list, drafter: str, monkeypatch) -> str | None:
    """A driver run on argv as its __main__ runs it, stopped where it would load its models:
    None if it gets there (every value taken), else the one line it refused them with. torch's
    threads and random state are put back (decode.py sets both before loading)."""
    drafter = str(drafter)
    argv = [str(a) for a in argv]
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    monkeypatch.setattr(distributed, "start_process_group", reached)
    monkeypatch.setattr(evaluation, "load_trained", reached)
    monkeypatch.setattr(decode, "load", reached)
    try:
        if where == "train.py":
            train.cli_main(argv)
        elif where == "train.py prune":
            train.cli_main(["prune", "--drafter", drafter, "--min-layers", "1", *argv])
        elif where == "train.py eval":
            train.cli_main(["eval", "--drafter", drafter, *argv])
        else:
            decode.cli_main(["--prompt", "1 + 2", *argv])
    except Reached:
        return None
    except runtime.UserError as refused:
        return str(refused)
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    raise AssertionError(f"{where} {argv}: the run neither loaded nor refused")


def make_config(where: str, name: str, value) -> str | None:
    """A config made with one field set: None if it is taken, else the error's line."""
    try:
        CONFIGS[where](**{name: value})
    except runtime.UserError as refused:
        return str(refused)
    return None


@pytest.mark.filterwarnings("ignore:bf16 on a CPU")
@pytest.mark.parametrize("where,name,row", list(cells()))
def test_every_flag_and_setting_takes_what_its_documented_range_says(
    where, name, row, folders, drafter_folder, monkeypatch
):
    """The table's rule, never the code's Range: a value inside is taken as far as the run's
    loading, a value outside is refused in one line that names the flag (or the field)."""
    needs = [str(folders / "prompts.jsonl") if n == "{prompts}" else n for n in row.needs]
    for value, taken in probes(row):
        if where in CONFIGS:
            said = make_config(where, name, value)
            named = f"{where.split('.')[1]}.{name}"
        else:
            given = value
            if not isinstance(value, list):
                given = [value]
            argv = [*needs, name, *given]
            said = run_until_loading(where, argv, drafter_folder, monkeypatch)
            named = name
        if taken:
            assert said is None, f"{where} {name} {value!r} is in the documented range: {said}"
            continue
        assert said is not None, f"{where} {name} {value!r} is outside the range, yet taken"
        assert "\n" not in said, said
        assert named in said or (isinstance(value, str) and value in said), said


PARSERS = {
    "train.py": train.parse_args,
    "train.py prune": pruning.parse_prune_args,
    "train.py eval": evaluation.parse_eval_args,
    "decode.py": decode.parse_args,
}


def parsed_defaults(where: str) -> dict:
    """{flag: (its keyword, the value a run gets without it)} of a driver's parser."""
    parse = PARSERS[where]
    defaults = vars(parse([]))
    found = {}
    for action in parser_actions(parse):
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                found[flag] = (action.dest, defaults[action.dest])
    return found


@pytest.mark.parametrize("where", list(PARSERS))
def test_the_table_names_every_flag_and_its_default(where):
    """Every flag of the driver has a row (a flag added gets one), and the parser's default is
    the row's; train.py's defaults that depend on the run, once filled in for a user's model
    and for the toy."""
    found = parsed_defaults(where)
    assert sorted(found) == sorted(TABLE[where]), f"{where}: the table and the parser differ"
    for flag, (dest, default) in found.items():
        row = TABLE[where][flag]
        if where == "train.py" and dest in train_flags.TOY_DEFAULTS:
            assert default is None, f"{flag}: the run decides its default"
            continue
        assert default == row.default, f"{where} {flag}: default {default!r}, table {row.default!r}"
    if where != "train.py":
        return
    for toy_run in (False, True):
        args = train.parse_args([])
        train_flags.fill_defaults(args, toy_run=toy_run)
        for flag, row in TABLE[where].items():
            wanted = row.default
            if toy_run and row.toy is not None:
                wanted = row.toy
            dest = found[flag][0]
            assert getattr(args, dest) == wanted, f"{flag} (toy: {toy_run}): {wanted!r}"


@pytest.mark.parametrize("where", list(PARSERS))
def test_each_switch_sets_the_other_value(where):
    """A flag without a value sets its keyword to the other value: True, or False for --no-X."""
    found = parsed_defaults(where)
    for flag, row in TABLE[where].items():
        if row.kind != SWITCH:
            continue
        wanted = not flag.startswith("--no-")
        if row.default is not None:
            wanted = not row.default
        dest = found[flag][0]
        assert getattr(PARSERS[where]([flag]), dest) is wanted, flag


@pytest.mark.parametrize("where", list(CONFIGS))
def test_the_table_names_every_setting_of_the_configs_and_its_default(where):
    settings = {f.name: f.default for f in dataclasses.fields(CONFIGS[where])}
    assert sorted(settings) == sorted(TABLE[where])
    for name, default in settings.items():
        assert default == TABLE[where][name].default, f"{where}.{name}: default {default!r}"
