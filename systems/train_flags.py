"""train.py's flags and what they name: a dataclass per group of `python train.py --help`
(each field one flag, cli.add_settings) beside d3d.D3DConfig's and train.py's TrainSettings;
the defaults that depend on the run (the toy's against a user's model's); the files a run
reads (Inputs), the built-in toy's where no --target is given; and the target's answers to
its prompts (load_answers), which `train.py eval` and `prune` read again from the
train_args.json a run wrote."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
from dataclasses import dataclass

import runtime
from runtime import Range
from systems import answers, cli, pictures

# the toy's runs: the default drafter, and answers to any prompts the toy does not ship
TOY_RUNS = "runs/toy"


@dataclass
class DataSettings:
    """Where the training answers come from (answers.load_data)."""

    target: str | None = cli.flag(
        None, "target model: HF folder or hub name (default: the toy, --toy)"
    )
    # its default, toy.SHIPPED, is train.py's to give: systems/ sits below toy.py
    toy: str | None = cli.flag(
        None,
        "toy folder, when no --target: its target, prompts and answers, checked against its "
        "toy.json (default: the repository's, toy-target/; `python toy.py` builds others)",
    )
    prompts: str | None = cli.flag(
        None, "JSON Lines file of training prompts (default: the toy's train prompts)"
    )
    prompt_field: str = cli.flag("question", "field holding the prompt")
    val_prompts: str | None = cli.flag(
        None,
        "JSON Lines file of held-out prompts (default: toy test prompts, else --val-fraction "
        "of --prompts)",
    )
    val_fraction: float = cli.flag(
        0.05,
        "share of --prompts held out when there is no --val-prompts",
        Range(float, low=0, high=1, low_open=True, high_open=True),
    )
    num_prompts: int | None = cli.flag(
        None, "use the first N training prompts (default: all)", Range(int, low=1)
    )
    num_val: int = cli.flag(200, "use the first N held-out prompts", Range(int, low=1))
    thinking: bool = cli.flag(False, "Qwen3: answer with thinking on (default: off)", Range(bool))
    max_new_tokens: int = cli.flag(256, "cap on a target answer, tokens", Range(int, low=1))
    gen_batch_size: int = cli.flag(64, "prompts answered together", Range(int, low=1))
    data_dir: str | None = cli.flag(
        None,
        "where the answer caches go (default: the folder above --out; runs/toy for prompts "
        "the toy does not ship answers to)",
    )


@dataclass
class DrafterSettings:
    """What the drafter starts from (build_drafter)."""

    drafter_init: str | None = cli.flag(
        None, "causal LM with the target's tokenizer to start from (default: the target)"
    )
    drafter_layers: str | None = cli.flag(
        None,
        "keep N layers evenly spaced (first and last kept) or ids '0,5,29' (default: all; "
        "the first 2, '0,1', for the toy)",
    )
    random_init: bool = cli.flag(
        False,
        "same architecture as --drafter-init, random weights (the paper's Fig. 2; default: "
        "its pretrained weights)",
        Range(bool),
    )


@dataclass
class RunSettings:
    """Where and how the run computes, and what it draws at the end."""

    dtype: str = cli.flag(
        "auto",
        "bfloat16 autocast (fp32 master weights) or float32 (auto = bfloat16 where the device "
        "does it natively: CUDA, or a CPU with AVX512-BF16/AMX; else float32)",
        cli.DTYPE_RANGE,
    )
    gradient_checkpointing: bool = cli.flag(
        False,
        "recompute each layer's activations in backward: less memory (SmolLM2, K 64, batch 2, "
        "1,024 tokens: 3.2 -> 2.2 GiB), ~30 % more compute",
        Range(bool),
    )
    # rank 0 works alone while the others wait in a collective: it reads the whole
    # checkpoint before the first broadcast, and at the end writes the gathered
    # drafter. At 8B that is 16 GB read into 33 GB of fp32 and 16 GB of bf16 written:
    # minutes on a local disk, ~30 min at 10 MB/s on a slow network disk. NCCL's own
    # default (10 min) would kill a healthy run there; 60 min still ends a hung one
    # within the hour
    dist_timeout: float = cli.flag(
        60.0,
        "how long a process waits for the others in a collective before the run fails "
        "(torchrun and --fsdp; 60 lets rank 0 read and write an 8B drafter alone while the "
        "others wait)",
        Range(float, low=0, low_open=True),
        metavar="MINUTES",
    )
    plot: str | None = cli.flag(
        None,
        "at the end, draw the share of held-out blocks with d_1 .. d_i all accepted, by "
        "position i, d_1 from the head and from MASK 1 (as train.py eval --plot); needs "
        "matplotlib (requirements-plots.txt)",
        metavar="PATH.png",
    )
    threads: int | None = cli.flag(
        None,
        "torch CPU threads (the toy's tiny models run fastest on one; use 1 on a CPU shared "
        "with other jobs)",
        Range(int, low=1),
    )
    device: str | None = cli.flag(
        None, "cpu, cuda, ... (default: cuda if available; cuda:LOCAL_RANK under torchrun)"
    )


# d3d.D3DConfig's fields that are the drafter's, not flags: make_drafter sets them
NOT_FLAGS = ("mask_token_id", "target_vocab_size", "tokenizer_hash", "layer_ids")
# The toy's own settings where a flag is not given (short answers, a 0.4M-parameter drafter)
TOY_DEFAULTS = {"block_size": 8, "num_anchors": 32, "lr": 6e-3, "threads": 1}
# Everywhere else
DEFAULTS = {"block_size": 16, "num_anchors": 64, "lr": 1e-3}


def fill_defaults(args: argparse.Namespace, toy_run: bool) -> None:
    """The documented defaults of flags the user did not give; a value given is kept."""
    defaults = DEFAULTS
    if toy_run:
        defaults = TOY_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_inputs(args: argparse.Namespace) -> None:
    """The files train.py's flags name, readable, and the flags that go together, given
    together (runtime.UserError, one line)."""
    if args.drafter_layers is not None and str(args.drafter_layers).strip() == "":
        raise runtime.UserError("--drafter-layers is empty — give a count N or ids '0,5,29'")
    if args.plot is not None:
        check_plotting()
    if args.target is not None:
        cli.check_model_folder("--target", args.target)
        if args.prompts is None:
            fix = "give a JSON Lines file of prompts"
            raise runtime.UserError(f"--target needs --prompts — {fix}")
    # a prompts file given is read on a toy run, too
    if args.prompts is not None:
        cli.read_jsonl("--prompts", args.prompts)
    if args.val_prompts is not None:
        cli.read_jsonl("--val-prompts", args.val_prompts)
    if args.target is not None and args.drafter_init is not None:
        cli.check_model_folder("--drafter-init", args.drafter_init)


def check_plotting() -> None:
    """--plot needs matplotlib: without it, a one-line error naming the install, before
    any work is done."""
    if importlib.util.find_spec("matplotlib") is None:
        raise runtime.UserError(f"--plot: {pictures.MISSING}")


def given(parse, flags: dict) -> argparse.Namespace:
    """A driver's flags given as keywords (`main(**flags)`): the defaults of `parse([])`, the
    given ones over them; a keyword that is no flag is a TypeError, as for any function."""
    defaults = vars(parse([]))
    unknown = flags.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"unknown arguments: {sorted(unknown)}")
    return argparse.Namespace(**{**defaults, **flags})


# the files of Inputs that train_args.json records, under these names
RECORDED = ("target", "prompts", "val_prompts", "answers", "val_answers")


@dataclass
class Inputs:
    """What a run reads besides its flags: the target, the training and the held-out prompts
    (None: the last --val-fraction of the training ones), the answer files shipped with them
    (None: the target writes them), the folder of the answer caches and the layers the
    drafter keeps. train_args.json records the files under these names."""

    target: str
    prompts: str
    val_prompts: str | None = None
    answers: str | None = None
    val_answers: str | None = None
    cache_dir: str = "."
    layers: str | None = None

    def recorded(self) -> dict:
        """The files (RECORDED) as train_args.json records them: the toy's relative to the
        repository, a user's as given (runtime.record_path)."""
        return {name: runtime.record_path(getattr(self, name)) for name in RECORDED}


def inputs_of(args: argparse.Namespace, paths: dict | None, rank: int) -> Inputs:
    """The files the flags name. Without --target (`paths`: toy.open_toy's) the flags not
    given point at the built-in toy (toy.py: scaffolding, not the method): its target,
    prompts and shipped answers. One toy for every run, wherever --out puts the drafter: the
    same target and the same answers, checked against toy.json."""
    inputs = Inputs(args.target, args.prompts, args.val_prompts, layers=args.drafter_layers)
    if paths is not None:
        if rank == 0:
            print(
                f"[toy] target and its answers from {paths['target']}; the drafter goes to "
                f"{args.out}"
            )
        inputs.target = paths["target"]
        if args.prompts is None:
            inputs.prompts = paths["train"]
            inputs.answers = paths["train_answers"]
        if args.val_prompts is None:
            inputs.val_prompts = paths["test"]
            inputs.val_answers = paths["test_answers"]
        if args.data_dir is None:
            args.data_dir = TOY_RUNS
        if inputs.layers is None:
            # the target's first 2 layers, the plain prefix (LAB.md, exercise 5, compares others)
            inputs.layers = "0,1"
    inputs.cache_dir = args.data_dir
    if inputs.cache_dir is None:
        inputs.cache_dir = os.path.dirname(os.path.abspath(args.out))
    return inputs


# train.py's flags that are fields of answers.Answering (train_args.json records them)
ANSWERING = ("prompt_field", "thinking", "max_new_tokens", "gen_batch_size")


def load_answers(inputs: Inputs, flags: dict, tokenizer, **where) -> tuple[list, list]:
    """The target's answers to the training and the held-out prompts (answers.load_data:
    cached, or written now); without held-out prompts the last --val-fraction of --prompts.
    `flags`: train.py's, as a run parsed them or its train_args.json recorded them; `where`:
    where the target answers (answers.Answering's device, dtype, rank, world)."""
    flagged = {name: flags[name] for name in ANSWERING}
    answering = answers.Answering(**flagged, cache_dir=inputs.cache_dir, **where)
    load = functools.partial(answers.load_data, inputs.target, tokenizer, answering=answering)
    train = load(prompts=inputs.prompts, num_prompts=flags["num_prompts"], answers=inputs.answers)
    if not inputs.val_prompts:
        num_val = min(flags["num_val"], round(len(train) * flags["val_fraction"]))
        if num_val == 0:
            raise runtime.UserError(
                f"--val-fraction {flags['val_fraction']} of {len(train)} prompts holds out none "
                "— give --val-prompts, a larger --val-fraction, or more --prompts"
            )
        return train[:-num_val], train[-num_val:]
    val = load(prompts=inputs.val_prompts, num_prompts=flags["num_val"], answers=inputs.val_answers)
    return train, val
