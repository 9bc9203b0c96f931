"""`python train.py prune --drafter FOLDER ...`: progressive layer pruning of a trained
drafter (paper Fig. 1b; d3d.prune_drafter) on the answers it was trained with, then the
pruned and unpruned drafters decode the same held-out prompts against the target in one run."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os

import torch
from tqdm.auto import tqdm

import d3d
import runtime
from runtime import Range
from systems import answers, cli, decoding, evaluation, fast, figures, memory, pictures, train_flags


@dataclasses.dataclass
class PruneFlags:
    """What `train.py prune` reads and writes besides d3d.PruneConfig: the pruned folder, the
    batches, the comparison with the target, the precision."""

    out: str | None = cli.flag(
        None, "pruned drafter folder (default: DRAFTER-pruned); prune_table.json goes in it"
    )
    batch_size: int = cli.flag(8, "sequences per batch", Range(int, low=1))
    num_val: int = cli.flag(64, "held-out answers for validation tau", Range(int, low=1))
    compare_prompts: int = cli.flag(
        8,
        "held-out prompts decoded with the unpruned and the pruned drafter against the target, "
        "for the speedup (0 = skip)",
        Range(int, low=0),
    )
    max_new_tokens: int = cli.flag(128, "tokens per compared answer", Range(int, low=1))
    dtype: str | None = cli.flag(
        None,
        "bfloat16 autocast for scoring and recovery (fp32 master weights), or float32 "
        "(default: auto on CUDA = bfloat16 where native; float32 on a CPU)",
        cli.DTYPE_RANGE,
    )
    gradient_checkpointing: bool | None = cli.flag(
        None,
        "recompute each layer's activations in the backward of recovery steps: less memory, "
        "~30 % more compute (default: on with CUDA, off on a CPU)",
        action=argparse.BooleanOptionalAction,
    )
    plot: str | None = cli.flag(
        None,
        "draw the pruning curve (Fig. 1b): tau before and after recovery at each depth; needs "
        "matplotlib (requirements-plots.txt)",
        metavar="PATH.png",
    )
    force: bool = cli.flag(
        False,
        "write --out and --plot over what train.py prune did not write there (a model, a "
        "training run, other files); the repository's toy-target/ never (default: refuse, "
        "before anything loads)",
        Range(bool),
    )


# d3d.PruneConfig's field that is no flag: --gradient-checkpointing decides it by the device
NOT_FLAGS = ("checkpointing",)
GROUPS = {
    "the trained drafter": evaluation.TrainedDrafter,
    "pruning (d3d.PruneConfig; a stopping rule at least: --min-layers, --tau-floor or both)": (
        d3d.PruneConfig,
        NOT_FLAGS,
    ),
    "output, recovery batches and comparison": PruneFlags,
}
# the driver's own defaults, with which LAB.md's pruning runs were measured
DEFAULTS = {"recovery_steps": 50, "lr": 1e-4, "val_anchors": 16}
# a floor above the unpruned tau would stop before any removal
NARROWER = {"tau_floor": Range(float, low=0, high=1, low_open=True)}
# {field: Range} of every flag, as check_ranges takes them. Zero is legal where it means
# something: --recovery-steps 0 (no recovery), --compare-prompts 0 (no comparison), --beta 0.
PRUNE_RANGES, _ = cli.flag_ranges(GROUPS, NARROWER)


def parse_prune_args(argv=None) -> argparse.Namespace:
    """The flags of `train.py prune`, a group per settings dataclass."""
    ap = cli.Parser(
        prog="train.py prune",
        description="Progressive layer pruning of a trained drafter "
        "with recovery distillation (paper Fig. 1b), on the answers it was trained with.",
    )
    cli.add_groups(ap, GROUPS, defaults=DEFAULTS)
    return ap.parse_args(argv)


def check_prune_args(values: dict) -> None:
    """Every flag of `train.py prune` in its range, a stopping rule, the drafter's folder, and
    the paths it writes free to write (cli.check_output), before anything loads."""
    cli.check_flags(values, GROUPS, NARROWER)
    if values.get("min_layers") is None and values.get("tau_floor") is None:
        raise runtime.UserError(
            "train.py prune needs a stopping rule — give --min-layers N, --tau-floor F, or both"
        )
    if values.get("plot") is not None:
        train_flags.check_plotting()
    cli.check_drafter_folder("--drafter", values["drafter"])
    # what the run writes: a pruned drafter's folder, a picture
    force = values["force"]
    cli.check_output("--out", pruned_folder(values), cli.PRUNED_DRAFTER, force)
    cli.check_output("--plot", values["plot"], cli.PICTURE, force)


def pruned_folder(values: dict) -> str:
    """Where the pruned drafter goes: --out, by default DRAFTER-pruned; never the drafter being
    pruned."""
    out = values["out"]
    if out is None:
        out = values["drafter"].rstrip("/") + "-pruned"
    if os.path.realpath(out) == os.path.realpath(values["drafter"]):
        raise runtime.UserError(f"--out {out} is the drafter being pruned — give another folder")
    return out


@torch.no_grad()
def compare_drafters(target, drafters: dict, prompts, config: d3d.DecodeConfig) -> dict:
    """Decode the same prompts as `config` says with each drafter (sync and async) and with the
    target alone, in one run: tau and speedup (figures.summarise: target-only time per token /
    speculative time per token, prefill excluded) per drafter and mode."""
    records = collections.defaultdict(list)
    runs = [("target", None, "target")] + [
        (f"{name} {mode}", d, mode) for name, d in drafters.items() for mode in ("sync", "async")
    ]
    d3d.generate(target, None, prompts[0], max_new_tokens=4, mode="target")  # warm-up
    for ids in tqdm(prompts, desc="decode with each drafter", leave=False):
        for label, drafter, mode in runs:
            out, stats = d3d.generate(target, drafter, ids, config, mode=mode)
            records[label].append(decoding.record(ids, out, stats))
    compared = {}
    for label, _, _ in runs[1:]:
        figures_of = figures.summarise(records[label], records["target"])
        compared[label] = {"speedup": figures_of["speedup"], "tau": figures_of["tau"]}
    return compared


def describe_iteration(row: dict, config: d3d.PruneConfig, tau0: float) -> list[str]:
    """What a row of d3d.prune_drafter says, in a line or two."""
    tau = row["tau_after_recovery"]
    if row["removed_layer"] is None:
        return [f"unpruned: {row['layers']} layers, tau {tau:.3f}"]
    line = f"removed layer {row['removed_layer']}: {row['layers']} left, "
    line += f"tau {row['tau_before_recovery']:.3f}"
    if config.recovery_steps > 0:
        line += f" -> {tau:.3f} after recovery"
    line += f" ({row['seconds']:.0f} s, scoring {row['score_seconds']:.0f} s)"
    if row["recovery_skipped"]:
        line += (
            f"; recovery skipped {row['recovery_skipped']} of {config.recovery_steps} steps: "
            "gradient norm not finite"
        )
    if row["kept"]:
        return [line]
    return [line, f"tau {tau:.3f} < {config.tau_floor} x {tau0:.3f}: removal undone, stopping"]


def prune_main(**flags) -> dict:
    """`python train.py prune`: the flags of parse_prune_args as keywords (defaults as there),
    checked before anything loads; d3d.prune_drafter on the answers the drafter was trained
    with, then unpruned vs pruned decoding against the target, the pruned folder and its
    table (prune_table.json). Returns the table's figures."""
    f = train_flags.given(parse_prune_args, flags)
    check_prune_args(vars(f))
    device = runtime.resolve_device(f.device)
    out, bf16, config = settings(f, device)
    trained = evaluation.load_trained(f.drafter, device)
    recipe = trained.recipe
    model = trained.drafter
    val_batches, train_batches = batches(trained, f, device)
    # the unpruned drafter for the final comparison waits in host memory: on the device it
    # would sit beside the teacher copy prune_drafter makes
    unpruned = runtime.host_copy(model) if f.compare_prompts else None
    print(
        f"[prune] {f.drafter}: {model.model.config.num_hidden_layers} layers; "
        f"{len(val_batches)} validation and {len(train_batches)} recovery batches of "
        f"{f.batch_size}"
    )
    estimate = recovery_estimate(model, train_batches, f.batch_size, config, device)
    table = prune(model, val_batches, train_batches, config, bf16, device)
    result = {
        "table": table,
        "drafter": os.path.abspath(f.drafter),
        "recovery_steps": config.recovery_steps,
        "beta": config.beta,
        "lr": config.lr,
        "dtype": "bfloat16" if bf16 else "float32",
        "num_val": min(f.num_val, len(trained.val)),
        "val_anchors": config.val_anchors,
        "layer_ids": model.d3d_config.layer_ids,
        "checkpointing": config.checkpointing,
        "peak_memory_estimate_gib": round(estimate["total"], 2),
        "peak_memory_gib": round(memory.peak_memory_gib(device), 2),
    }
    if f.compare_prompts:
        target = runtime.load_causal_lm(recipe["target"], torch.float32, device).eval()
        prompts = [torch.tensor([p], device=device) for p, _ in trained.val[: f.compare_prompts]]
        eos = getattr(target.generation_config, "eos_token_id", None)
        if eos is None:
            eos = trained.tokenizer.eos_token_id
        drafters = {"unpruned": unpruned.to(device).eval(), "pruned": model.eval()}
        decode_config = d3d.DecodeConfig(max_new_tokens=f.max_new_tokens, eos_token_id=eos)
        result["decode"] = compare_drafters(target, drafters, prompts, decode_config)
    save_pruned(model, trained.tokenizer, recipe, f.drafter, out, result)
    print_done(model, result, config, f.plot, device, out)
    return result


def settings(f: argparse.Namespace, device) -> tuple[str, bool, d3d.PruneConfig]:
    """(the pruned folder, whether to compute in bf16, the PruneConfig) of the flags on
    `device`: the defaults that depend on it filled in."""
    out = pruned_folder(vars(f))
    # a GPU prunes in bf16 autocast like training; a CPU keeps exact fp32 (bf16 is slow on most)
    dtype = f.dtype
    if dtype is None:
        dtype = "auto" if device.type == "cuda" else "float32"
    bf16 = runtime.resolve_dtype(dtype, device) == torch.bfloat16
    # activation checkpointing: by default on CUDA, off on a CPU
    checkpointing = f.gradient_checkpointing
    if checkpointing is None:
        checkpointing = device.type == "cuda"
    config = cli.settings_of(d3d.PruneConfig, vars(f), NOT_FLAGS, checkpointing=checkpointing)
    return out, bf16, config


def batches(trained: evaluation.Trained, f, device) -> tuple[list, list]:
    """(validation batches of the first --num-val held-out answers, recovery batches of the
    training answers in a seeded order), each (input_ids, loss_mask) on `device`, cut at the
    --max-len the drafter was trained with."""
    size = f.batch_size
    val = trained.val
    train = trained.train
    max_len = trained.recipe["max_len"]

    def batch(examples):
        return tuple(t.to(device) for t in answers.collate(examples, trained.pad_id, max_len))

    val_batches = [batch(val[s : s + size]) for s in range(0, min(f.num_val, len(val)), size)]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(f.seed)).tolist()
    starts = range(0, len(order) - size + 1, size)
    train_batches = [batch([train[i] for i in order[s : s + size]]) for s in starts]
    return val_batches, train_batches


def recovery_estimate(model, train_batches, batch_size: int, config, device) -> dict:
    """memory.prune_memory_estimate of a recovery step after the first removal, printed."""
    text_config = model.model.config.get_text_config()
    longest = max((ids.shape[1] for ids, _ in train_batches), default=0)
    seq_len = longest + config.val_anchors * model.d3d_config.block_size
    shapes = memory.StepShapes(
        num_params=sum(p.numel() for p in model.parameters()),
        hidden=text_config.hidden_size,
        # recovery follows the first removal
        layers=max(text_config.num_hidden_layers - 1, 1),
        batch=batch_size,
        seq_len=seq_len,
        vocab=model.d3d_config.target_vocab_size,
        checkpointing=config.checkpointing,
    )
    estimate = memory.prune_memory_estimate(shapes, device.type)
    print(
        f"[prune] estimated peak of a recovery step: {estimate['total']:.1f} GiB = "
        + ", ".join(f"{name} {gib:.1f}" for name, gib in estimate.items() if name != "total")
        + f" (activation checkpointing {'on' if config.checkpointing else 'off'}; the snapshot "
        "--tau-floor undoes to is kept on the CPU, not counted)"
    )
    return estimate


def prune(model, val_batches, train_batches, config: d3d.PruneConfig, bf16: bool, device):
    """d3d.prune_drafter's rows, each told as it comes (describe_iteration); bf16: under
    autocast."""
    autocast = contextlib.nullcontext()
    if bf16:
        # no cast cache: each use of a weight (the head, on the blocks and on the causal
        # stream) casts anew, so its recovery gradient sums in fp32, not in one cached bf16
        # copy
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    table = []
    with autocast:
        rows = d3d.prune_drafter(
            model, val_batches, train_batches, config, score=fast.tau_without_each_layer
        )
        for row in rows:
            table.append(row)
            tau0 = table[0]["tau_after_recovery"]
            for line in describe_iteration(row, config, tau0):
                tqdm.write(f"[prune] {line}")
    return table


def save_pruned(model, tokenizer, recipe: dict, drafter: str, out: str, result: dict) -> None:
    """The pruned drafter folder: the drafter, its train_args.json (the recipe it was trained
    with, and where it was pruned from), prune_table.json."""
    model.save_pretrained(out, tokenizer=tokenizer)
    record = {**recipe, "target": runtime.record_path(recipe["target"])}
    record["pruned_from"] = runtime.record_path(drafter)
    record["layer_ids"] = model.d3d_config.layer_ids
    with open(os.path.join(out, "train_args.json"), "w") as f:
        json.dump(record, f, indent=2)
    with open(os.path.join(out, "prune_table.json"), "w") as f:
        json.dump(result, f, indent=2)


def print_done(model, result: dict, config: d3d.PruneConfig, plot, device, out: str) -> None:
    """The table of removals, the decoding comparison, the curve (--plot), where it all went."""
    table = result["table"]
    print(
        f"\n{'removed':>8}{'layers':>8}{'tau before':>12}{'tau after':>11}"
        f"{'% of tau0':>11}{'scoring s':>11}{'total s':>9}  (tau: offline, "
        f"B={model.d3d_config.block_size}, {result['num_val']} held-out answers x "
        f"{config.val_anchors} blocks, after recovery of {config.recovery_steps} steps)"
    )
    tau0 = table[0]["tau_after_recovery"]
    for row in table:
        removed = row["removed_layer"]
        if removed is None:
            removed = "-"
        tau = row["tau_after_recovery"]
        line = f"{removed:>8}{row['layers']:>8}{row['tau_before_recovery']:>12.3f}"
        line += f"{tau:>11.3f}{100 * tau / tau0:>10.1f}%"
        line += f"{row['score_seconds']:>11.0f}{row['seconds']:>9.0f}"
        if not row["kept"]:
            line += "  (undone: below the floor)"
        print(line)
    for label, r in result.get("decode", {}).items():
        print(
            f"[decode] {label:<16} speedup {r['speedup']:.2f}x over target-only, tau {r['tau']:.2f}"
        )
    if plot is not None:
        path = pictures.draw_pruning_curve(plot, table, tau_floor=config.tau_floor)
        print(f"[done] pruning curve: {path}")
    print(
        f"[done] peak memory {result['peak_memory_gib']:.2f} GiB "
        f"({'GPU allocated' if device.type == 'cuda' else 'RSS'}; "
        f"estimated {result['peak_memory_estimate_gib']:.2f})"
    )
    print(
        f"[done] pruned drafter ({model.model.config.num_hidden_layers} layers, original ids "
        f"{model.d3d_config.layer_ids}): {os.path.abspath(out)}; "
        f"table: {os.path.join(out, 'prune_table.json')}"
    )
