"""Offline tau of a drafter on held-out answers: the evaluation during and after training, its per-position
acceptance curve, and `python train.py eval` on a trained drafter folder (load_trained reloads the folder with the
answers it was trained on, for eval and prune alike)."""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

import d3d
import runtime
from systems import answers, cli, pictures


@torch.no_grad()
def evaluate_tau(
    drafter,
    examples,
    *,
    block_size: int,
    num_anchors: int = 32,
    batch_size: int = 8,
    pad_id: int,
    max_len: int = 1024,
    autocast=contextlib.nullcontext,
    seed: int = 0,
    d1_from=None,
    per_block: bool = False,
    sharded: torch.nn.Module | None = None,
):
    """Mean offline tau (accepted + 1) over blocks drafted at `num_anchors` sampled points per held-out answer (with
    per_block: the tau of every block, a tensor); d_1 from where the drafter's config says (d1_from overrides:
    "causal" or "mask"). `sharded`: the FSDP root (train.py's TrainingLoss) around `drafter`; every pass goes
    through its forward, which gathers the weights, so every process must evaluate, on the same examples."""
    generator = torch.Generator().manual_seed(seed)  # the same anchors at every evaluation
    was_training, taus = drafter.training, []
    drafter.eval()
    # under FSDP every pass goes through the root's forward, which gathers the weights
    run = (
        functools.partial(sharded, fn=d3d.offline_tau)
        if sharded is not None
        else functools.partial(d3d.offline_tau, drafter)
    )
    for s in tqdm(
        range(0, len(examples), batch_size), desc=f"offline tau B={block_size}", leave=False
    ):
        input_ids, loss_mask = answers.collate(examples[s : s + batch_size], pad_id, max_len)
        with autocast():
            taus.append(
                run(
                    input_ids.to(drafter.device),
                    loss_mask.to(drafter.device),
                    num_anchors=num_anchors,
                    block_size=block_size,
                    d1_from=d1_from,
                    generator=generator,
                )
            )
    if sharded is not None:
        sharded.reshard()  # the root stays gathered after a forward that no backward follows
    drafter.train(was_training)
    return torch.cat(taus) if per_block else torch.cat(taus).mean().item()


def acceptance_curve(taus: torch.Tensor, block_size: int) -> list[float]:
    """Per block position i = 1..B: the share of blocks whose drafts d_1 .. d_i were all accepted (tau > i)."""
    return [(taus > i).float().mean().item() for i in range(1, block_size + 1)]


def load_trained(drafter: str, device):
    """A trained drafter folder with what it was trained on: (recipe, tokenizer, drafter, train, val, pad_id); the
    answers come from the caches train.py wrote (train_args.json names them)."""
    cli.check_drafter_folder("--drafter", drafter)
    path = os.path.join(drafter, "train_args.json")
    if not os.path.isfile(path):
        raise runtime.UserError(
            f"--drafter {drafter} has no train_args.json — give a drafter "
            "folder that train.py wrote"
        )
    # how the drafter was trained: its target, prompts and answer caches
    recipe = cli.read_json("--drafter", path)
    needed = (
        "target",
        "prompts",
        "prompt_field",
        "thinking",
        "max_new_tokens",
        "gen_batch_size",
        "num_prompts",
        "num_val",
        "max_len",
        "val_anchors",
    )
    missing = [key for key in needed if key not in recipe]
    if missing:
        raise runtime.UserError(
            f"--drafter: {path} lacks {', '.join(missing)} — give a drafter "
            "folder that train.py wrote"
        )
    found = {}
    for key in ("target", "prompts", "val_prompts", "answers", "val_answers"):
        must_exist = key != "target" or not cli.looks_like_hub_name(recipe[key] or "")
        found[key] = runtime.find_recorded(recipe.get(key), f"{path}: {key}", must_exist)
    tokenizer = AutoTokenizer.from_pretrained(drafter)
    model = d3d.Drafter.from_pretrained(drafter, dtype=torch.float32, device=device)
    cache_dir = recipe.get("data_dir") or os.path.dirname(os.path.abspath(drafter))
    data = dict(
        tokenizer=tokenizer,
        prompt_field=recipe["prompt_field"],
        thinking=recipe["thinking"],
        cache_dir=cache_dir,
        max_new_tokens=recipe["max_new_tokens"],
        gen_batch_size=recipe["gen_batch_size"],
        device=device,
    )
    train = answers.load_data(
        found["target"],
        prompts=found["prompts"],
        num_prompts=recipe["num_prompts"],
        answers=found["answers"],
        **data,
    )
    if found["val_prompts"]:
        val = answers.load_data(
            found["target"],
            prompts=found["val_prompts"],
            num_prompts=recipe["num_val"],
            answers=found["val_answers"],
            **data,
        )
    else:
        num_held = min(recipe["num_val"], round(len(train) * recipe["val_fraction"]))
        train, val = train[: len(train) - num_held], train[len(train) - num_held :]
    recipe = {**recipe, "target": found["target"]}
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    return recipe, tokenizer, model, train, val, pad_id


EVAL_RANGES = {"num_val": cli.Range(int, low=1), "val_anchors": cli.Range(int, low=1)}


def eval_main(argv=None) -> dict:
    """python train.py eval --drafter FOLDER: offline tau on the held-out answers the drafter was trained with,
    with d_1 drafted by the causal next-token head ("causal") and by MASK 1 ("mask")."""
    ap = cli.Parser(prog="train.py eval", description=eval_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument(
        "--drafter",
        default="runs/toy/drafter",
        help="trained drafter folder (default: runs/toy/drafter)",
    )
    ap.add_argument("--num-val", type=int, help="held-out answers (default: as in training)")
    ap.add_argument(
        "--val-anchors", type=int, help="blocks per held-out answer (default: as in training)"
    )
    ap.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="bfloat16 autocast or float32 (default: as in training; auto: bfloat16 where native)",
    )
    ap.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    ap.add_argument(
        "--plot",
        metavar="PATH.png",
        help="draw the share of blocks with d_1 .. d_i "
        "all accepted, by position i, d_1 from the head and from MASK 1; needs "
        "matplotlib (requirements-plots.txt)",
    )
    args = ap.parse_args(argv)
    cli.check_ranges(vars(args), EVAL_RANGES)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe, _, drafter, _, val, pad_id = load_trained(args.drafter, device)
    num_val = args.num_val
    if num_val is None:
        num_val = recipe["num_val"]
    val = val[:num_val]
    val_anchors = args.val_anchors
    if val_anchors is None:
        val_anchors = recipe["val_anchors"]
    dtype = args.dtype or recipe.get("compute_dtype") or recipe.get("dtype")
    bf16 = runtime.resolve_dtype(dtype, device) == torch.bfloat16
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if bf16
        else contextlib.nullcontext
    )
    block_size = drafter.d3d_config.block_size
    taus = {
        first: evaluate_tau(
            drafter,
            val,
            block_size=block_size,
            pad_id=pad_id,
            max_len=recipe["max_len"],
            num_anchors=val_anchors,
            autocast=autocast,
            d1_from=first,
            per_block=True,
        )
        for first in ("causal", "mask")
    }
    result = {first: t.mean().item() for first, t in taus.items()}
    curves = {first: acceptance_curve(t, block_size) for first, t in taus.items()}
    print(
        f"[eval] {args.drafter}: offline tau (B={block_size}) on {len(val)} held-out answers "
        f"({len(taus['causal'])} blocks): {result['causal']:.3f} with d_1 from the causal next-token head, "
        f"{result['mask']:.3f} from MASK 1 (this drafter uses {drafter.d3d_config.d1_from!r})"
    )
    print(
        "[eval] share of blocks with d_1 .. d_i all accepted, and d_i accepted given d_1 .. d_(i-1) were:"
    )
    print(f"{'i':>4}{'head: all':>11}{'given':>7}{'MASK 1: all':>13}{'given':>7}")
    for i in range(block_size):
        row = "".join(
            f"{curves[f][i]:{w}.3f}{curves[f][i] / max(curves[f][i - 1] if i else 1.0, 1e-9):7.2f}"
            for f, w in (("causal", 11), ("mask", 13))
        )
        print(f"{i + 1:>4}{row}")
    if args.plot is not None:
        shares = {
            f"d_1 from {name}": curves[first]
            for first, name in (("causal", "the head"), ("mask", "MASK 1"))
        }
        path = pictures.draw_block_accuracy(
            args.plot, shares, title=f"{args.drafter}: share of blocks with d_1 .. d_i all accepted"
        )
        print(f"[eval] wrote {path}")
    return {**result, "curve": curves}
