"""Offline tau of a drafter on held-out answers: the evaluation during and after training,
its per-position acceptance curve (printed, and drawn with --plot), and `python train.py
eval` on a trained drafter folder (load_trained reloads the folder with the answers it was
trained on, for eval and prune alike)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

import d3d
import runtime
from runtime import Range
from systems import answers, cli, pictures, train_flags


@dataclasses.dataclass
class HeldOut:
    """How held-out answers are measured: `val_anchors` blocks drafted per answer, in batches
    of `batch_size` padded with `pad_id` and cut at `max_len`, under `autocast` (a context
    factory); the same `seed` draws the same anchors at every evaluation."""

    pad_id: int
    max_len: int = 1024
    val_anchors: int = 32
    autocast: Callable = contextlib.nullcontext
    batch_size: int = 8
    seed: int = 0

    def batches(self, examples, device):
        """(input_ids, loss_mask) of each batch of `examples` in turn, on `device`."""
        for s in range(0, len(examples), self.batch_size):
            chosen = examples[s : s + self.batch_size]
            input_ids, loss_mask = answers.collate(chosen, self.pad_id, self.max_len)
            yield input_ids.to(device), loss_mask.to(device)


@torch.no_grad()
def evaluate_tau(
    drafter, examples, held_out: HeldOut, *, d1_from=None, per_block=False, sharded=None
):
    """Mean offline tau (accepted + 1) over blocks of the drafter's B drafted at
    held_out.val_anchors sampled points per held-out answer (with per_block: the tau of every
    block, a tensor); d_1 from where the drafter's config says (d1_from, if given, replaces it
    for the measurement: "causal" or "mask").

    `sharded`: the FSDP root (train.py's TrainingLoss) around `drafter`; every pass goes
    through its forward, which gathers the weights, so every process must evaluate, on
    the same examples."""
    block_size = drafter.d3d_config.block_size
    taus = []
    # under FSDP every pass goes through the root's forward, which gathers the weights
    run = functools.partial(d3d.offline_tau, drafter)
    if sharded is not None:
        run = functools.partial(sharded, d3d.offline_tau)
    batches = held_out.batches(examples, drafter.device)
    total = math.ceil(len(examples) / held_out.batch_size)
    bar = tqdm(batches, total=total, desc=f"offline tau B={block_size}", leave=False)
    with measuring(drafter, held_out, d1_from=d1_from or drafter.d3d_config.d1_from) as generator:
        for input_ids, loss_mask in bar:
            with held_out.autocast():
                tau = run(
                    input_ids, loss_mask, val_anchors=held_out.val_anchors, generator=generator
                )
            taus.append(tau)
    if sharded is not None:
        sharded.reshard()  # the root stays gathered after a forward that no backward follows
    return torch.cat(taus) if per_block else torch.cat(taus).mean().item()


@torch.no_grad()
def block_accuracy(drafter, examples, held_out: HeldOut) -> list[float]:
    """d3d_loss's block_acc over the held-out answers: per block position i = 1..B, the share
    of blocks whose d_i, read where decoding reads it, is x_{j_k+i}. Each position on its own,
    unlike the acceptance curve. On the anchors evaluate_tau draws (the same seed and
    batches), so block_acc[0] is the share of blocks whose d_1 is accepted."""
    block_size = drafter.d3d_config.block_size
    right = torch.zeros(block_size, dtype=torch.float64)
    total = torch.zeros(block_size, dtype=torch.float64)
    # the block loss's metrics alone: lambda = 0 skips L_AR's rows
    with measuring(drafter, held_out, ar_weight=0.0) as generator:
        for input_ids, loss_mask in held_out.batches(examples, drafter.device):
            at = d3d.sample_anchors(loss_mask, held_out.val_anchors, generator)
            with held_out.autocast():
                _, metrics = d3d.d3d_loss(drafter, input_ids, loss_mask, at=at)
            counts = labelled_blocks(input_ids, loss_mask, at, block_size)
            right += metrics["block_acc"].double().cpu() * counts
            total += counts
    return (right / total.clamp(min=1)).tolist()


@contextlib.contextmanager
def measuring(drafter, held_out: HeldOut, **fields):
    """For the duration of a measurement: the drafter in eval mode with fields of its
    D3DConfig replaced (the FSDP root reaches the same drafter object), and a generator seeded
    with held_out.seed (the same anchors at every measurement); the drafter as it was after."""
    saved = drafter.d3d_config
    was_training = drafter.training
    drafter.d3d_config = dataclasses.replace(saved, **fields)
    drafter.eval()
    try:
        yield torch.Generator().manual_seed(held_out.seed)
    finally:
        drafter.d3d_config = saved
        drafter.train(was_training)


def labelled_blocks(input_ids, loss_mask, at, block_size: int) -> torch.Tensor:
    """Per block position i = 1..B, how many of the blocks at `at` (anchors, valid) have a
    label x_{j_k+i}: inside the sequence and a response token (block_acc's denominator)."""
    anchors, valid = at
    num_causal = input_ids.shape[1]
    steps = torch.arange(1, block_size + 1, device=anchors.device)
    index = anchors[:, :, None] + steps  # (b, K, B)
    inside = index < num_causal
    index = index.clamp(max=num_causal - 1)
    is_response = loss_mask.bool().gather(1, index.flatten(1)).view_as(index)
    counted = inside & is_response & valid[:, :, None]
    return counted.sum((0, 1)).double().cpu()


def print_block_accuracy(block_acc: list[float], d1_from: str) -> None:
    """Block accuracy by position, each row named by where its d_i is read."""
    print("[eval] block accuracy by position (each d_i on its own, d3d_loss's block_acc):")
    print(f"{'i':>4}{'accuracy':>10}  d_i read from")
    for i, accuracy in enumerate(block_acc, start=1):
        where = f"MASK {i}"
        if i == 1:
            where = f"d_1 (as decoding reads it): {D1_READ[d1_from]}"
        print(f"{i:>4}{accuracy:>10.3f}  {where}")


def acceptance_curve(taus: torch.Tensor, block_size: int) -> list[float]:
    """Per block position i = 1..B: the share of blocks whose drafts d_1 .. d_i were all
    accepted (tau > i). 1 + their sum is the mean tau."""
    return [(taus > i).float().mean().item() for i in range(1, block_size + 1)]


@dataclasses.dataclass
class Trained:
    """A drafter folder train.py wrote, loaded with what it was trained on (load_trained)."""

    # its train_args.json, the target in it as found on this machine
    recipe: dict
    tokenizer: object
    drafter: d3d.Drafter
    # the target's answers it was trained and measured on: (prompt ids, response ids) each
    train: list
    val: list
    # what pads a batch: the tokenizer's pad token, else EOS
    pad_id: int


def load_trained(drafter: str, device) -> Trained:
    """A trained drafter folder with what it was trained on; the answers come from the caches
    train.py wrote (train_args.json names them)."""
    cli.check_drafter_folder("--drafter", drafter)
    fix = "give a drafter folder that train.py wrote"
    path = os.path.join(drafter, "train_args.json")
    if not os.path.isfile(path):
        raise runtime.UserError(f"--drafter {drafter} has no train_args.json — {fix}")
    # how the drafter was trained: its target, prompts and answer caches
    recipe = cli.read_json("--drafter", path)
    needed = ("target", "prompts", *train_flags.ANSWERING, "num_prompts", "num_val")
    needed += ("max_len", "val_anchors")
    missing = [key for key in needed if key not in recipe]
    if missing:
        raise runtime.UserError(f"--drafter: {path} lacks {', '.join(missing)} — {fix}")
    found = {}
    for key in train_flags.RECORDED:
        must_exist = key != "target" or not cli.looks_like_hub_name(recipe[key] or "")
        found[key] = runtime.find_recorded(recipe.get(key), f"{path}: {key}", must_exist)
    if cli.is_toy(found["target"]):
        # the toy target it was trained for, and its answers: as its toy.json records them
        cli.check_toy(f"{path}: target", found["target"])
    cache_dir = recipe.get("data_dir") or os.path.dirname(os.path.abspath(drafter))
    inputs = train_flags.Inputs(**found, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(drafter)
    model = d3d.Drafter.from_pretrained(drafter, dtype=torch.float32, device=device)
    train, val = train_flags.load_answers(inputs, recipe, tokenizer, device=device)
    recipe = {**recipe, "target": found["target"]}
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    return Trained(recipe, tokenizer, model, train, val, pad_id)


@dataclasses.dataclass
class TrainedDrafter:
    """The drafter folder train.py wrote, which `train.py eval` and `train.py prune` read
    (load_trained), and where they run."""

    drafter: str = cli.flag("runs/toy/drafter", "trained drafter folder")
    device: str | None = cli.flag(None, "cpu, cuda, ... (default: cuda if available)")


@dataclasses.dataclass
class EvalFlags:
    """What `train.py eval` measures (default: as the drafter was trained)."""

    num_val: int | None = cli.flag(
        None, "held-out answers (default: as in training)", Range(int, low=1)
    )
    val_anchors: int | None = cli.flag(
        None, "blocks per held-out answer (default: as in training)", Range(int, low=1)
    )
    dtype: str | None = cli.flag(
        None,
        "bfloat16 autocast or float32 (default: as in training; auto: bfloat16 where native)",
        cli.DTYPE_RANGE,
    )
    plot: str | None = cli.flag(
        None,
        "draw the share of blocks with d_1 .. d_i all accepted, by position i, d_1 from the "
        "head and from MASK 1; needs matplotlib (requirements-plots.txt)",
        metavar="PATH.png",
    )
    force: bool = cli.flag(
        False,
        "write --plot over a file that is no picture this project drew (default: refuse, "
        "before anything loads); never into the repository's toy-target/",
        Range(bool),
    )


EVAL_GROUPS = {"the trained drafter": TrainedDrafter, "measurement": EvalFlags}
# {field: Range} of every flag, as check_ranges takes them
EVAL_RANGES, _ = cli.flag_ranges(EVAL_GROUPS)


def parse_eval_args(argv=None):
    """The flags of `train.py eval`, a group per settings dataclass."""
    description = eval_main.__doc__.split(":", 1)[1].strip()
    ap = cli.Parser(prog="train.py eval", description=description)
    cli.add_groups(ap, EVAL_GROUPS)
    return ap.parse_args(argv)


def eval_main(argv=None) -> dict:
    """python train.py eval --drafter FOLDER: offline tau on the held-out answers the
    drafter was trained with, with d_1 drafted by the causal row ("causal")
    and by MASK 1 ("mask")."""
    args = parse_eval_args(argv)
    cli.check_flags(vars(args), EVAL_GROUPS)
    if args.plot is not None:
        train_flags.check_plotting()
    cli.check_output("--plot", args.plot, cli.PICTURE, args.force)
    device = runtime.resolve_device(args.device)
    trained = load_trained(args.drafter, device)
    recipe = trained.recipe
    drafter = trained.drafter
    # the flags not given: as in training
    for name in ("num_val", "val_anchors"):
        if getattr(args, name) is None:
            setattr(args, name, recipe[name])
    val = trained.val[: args.num_val]
    dtype = args.dtype or recipe.get("compute_dtype") or recipe.get("dtype")
    bf16 = runtime.resolve_dtype(dtype, device) == torch.bfloat16
    held_out = HeldOut(
        trained.pad_id, recipe["max_len"], args.val_anchors, bf16_autocast(device, bf16)
    )
    block_size = drafter.d3d_config.block_size
    taus, curves = taus_and_curves(drafter, val, held_out)
    result = {first: t.mean().item() for first, t in taus.items()}
    print(
        f"[eval] {args.drafter}: offline tau (B={block_size}) on {len(val)} held-out "
        f"answers ({len(taus['causal'])} blocks): {result['causal']:.3f} with d_1 from "
        f"the causal row, {result['mask']:.3f} from MASK 1 (this drafter uses "
        f"{drafter.d3d_config.d1_from!r})"
    )
    print_curves(curves)
    block_acc = block_accuracy(drafter, val, held_out)
    print_block_accuracy(block_acc, drafter.d3d_config.d1_from)
    if args.plot is not None:
        title = f"{args.drafter}: share of blocks with d_1 .. d_i all accepted"
        path = draw_curves(args.plot, curves, title)
        print(f"[eval] wrote {path}")
    return {**result, "curve": curves, "block_acc": block_acc}


# ---------------------------------------------------------------------------------------------
# The acceptance curve by block position, printed and drawn (train.py --plot, eval --plot)

D1_SOURCES = {"causal": "the head", "mask": "MASK 1"}  # where d_1 is read, as the tables say
D1_READ = {"causal": "the causal row", "mask": "MASK 1"}  # the same, in sentences
OTHER_D1 = {"causal": "mask", "mask": "causal"}


def bf16_autocast(device: torch.device, on: bool):
    """A context factory: bfloat16 autocast on `device` if `on`, else nothing."""
    if on:
        return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def taus_and_curves(drafter, examples, held_out: HeldOut) -> tuple[dict, dict]:
    """evaluate_tau's tau of every held-out block and their acceptance curve, per place d_1 is
    read (D1_SOURCES)."""
    taus = {}
    curves = {}
    for d1_from in D1_SOURCES:
        taus[d1_from] = evaluate_tau(drafter, examples, held_out, d1_from=d1_from, per_block=True)
        curves[d1_from] = acceptance_curve(taus[d1_from], drafter.d3d_config.block_size)
    return taus, curves


def print_curves(curves: dict[str, list[float]], tag: str = "[eval]") -> None:
    """The acceptance curves as a table: per position i, the share of blocks with
    d_1 .. d_i all accepted, and the share with d_i accepted given d_1 .. d_(i-1) were."""
    print(
        f"{tag} share of blocks with d_1 .. d_i all accepted, and d_i accepted given "
        "d_1 .. d_(i-1) were:"
    )
    print(f"{'i':>4}{'head: all':>11}{'given':>7}{'MASK 1: all':>13}{'given':>7}")
    widths = {"causal": 11, "mask": 13}
    for i in range(len(curves["causal"])):
        row = ""
        for first, width in widths.items():
            share = curves[first][i]
            before = 1.0
            if i > 0:
                before = curves[first][i - 1]
            given = share / max(before, 1e-9)
            row += f"{share:{width}.3f}{given:7.2f}"
        print(f"{i + 1:>4}{row}")


def draw_curves(path: str, curves: dict[str, list[float]], title: str) -> str:
    """The acceptance curves as bars by block position (pictures.draw_block_accuracy),
    one series per place d_1 is read. Returns the path written."""
    shares = {f"d_1 from {D1_SOURCES[first]}": curves[first] for first in D1_SOURCES}
    return pictures.draw_block_accuracy(path, shares, title=title)


def plot_curves(path: str, drafter, examples, held_out: HeldOut, title: str) -> dict:
    """At the end of training (train.py --plot): the acceptance curves of `drafter` on
    the held-out answers, printed as a table and drawn at `path`. Returns the curves."""
    _, curves = taus_and_curves(drafter, examples, held_out)
    print_curves(curves, tag="[done]")
    print(f"[done] block acceptance by position: {draw_curves(path, curves, title)}")
    return curves
