"""`python train.py prune --drafter FOLDER ...`: progressive layer pruning of a trained
drafter (paper Fig. 1b; d3d.prune_drafter) on the answers it was trained with, then the
pruned and unpruned drafters decode the same held-out prompts against the target in one run."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os

import torch
from tqdm.auto import tqdm

import d3d
import runtime
from systems import answers, cli, evaluation, fast, memory, pictures


def parse_prune_args(argv=None) -> argparse.Namespace:
    ap = cli.Parser(
        prog="train.py prune",
        description="Progressive layer pruning of a trained drafter "
        "with recovery distillation (paper Fig. 1b), on the answers it was trained with.",
    )
    g = ap.add_argument_group("input and output")
    g.add_argument(
        "--drafter",
        default="runs/toy/drafter",
        help="trained drafter folder (default: runs/toy/drafter)",
    )
    g.add_argument(
        "--out", help="pruned drafter folder (default: DRAFTER-pruned); prune_table.json goes in it"
    )
    g = ap.add_argument_group("stopping rule (one at least)")
    g.add_argument("--min-layers", type=int, help="stop at this many layers")
    g.add_argument(
        "--tau-floor",
        type=float,
        help="stop before tau falls below this fraction of the unpruned tau",
    )
    g = ap.add_argument_group("recovery and evaluation")
    g.add_argument(
        "--recovery-steps",
        type=int,
        default=50,
        help="distillation steps after each removal; 0 = no recovery (default: 50)",
    )
    g.add_argument("--lr", type=float, default=1e-4, help="recovery learning rate (default: 1e-4)")
    g.add_argument(
        "--beta",
        type=float,
        default=0.5,
        help="teacher adjusted toward the label by beta (default: 0.5)",
    )
    g.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: 8)")
    g.add_argument(
        "--num-val", type=int, default=64, help="held-out answers for validation tau (default: 64)"
    )
    g.add_argument(
        "--val-anchors", type=int, default=16, help="blocks per held-out answer (default: 16)"
    )
    g.add_argument(
        "--compare-prompts",
        type=int,
        default=8,
        help="held-out prompts decoded with the unpruned and "
        "the pruned drafter against the target, for the speedup (default: 8; 0 = skip)",
    )
    g.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens per compared answer (default: 128)"
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        help="bfloat16 autocast for scoring and recovery (fp32 master weights), or float32 "
        "(default: auto on CUDA = bfloat16 where native; float32 on a CPU)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="recompute each layer's activations in the backward of recovery steps: less "
        "memory, ~30 %% more compute (default: on with CUDA, off on a CPU)",
    )
    g.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0, help="anchors and batch order (default: 0)")
    g.add_argument(
        "--plot",
        metavar="PATH.png",
        help="draw the pruning curve (Fig. 1b): tau before "
        "and after recovery at each depth; needs matplotlib (requirements-plots.txt)",
    )
    return ap.parse_args(argv)


# The values each flag of `train.py prune` accepts (None: not given). Zero is legal where it
# means something: --recovery-steps 0 (no recovery), --compare-prompts 0 (no comparison), --beta 0.
PRUNE_RANGES = {
    "min_layers": cli.Range(int, low=1),
    "tau_floor": cli.Range(float, low=0, high=1, low_open=True),
    "recovery_steps": cli.Range(int, low=0),
    "lr": cli.Range(float, low=0, low_open=True),
    "beta": cli.Range(float, low=0, high=1),
    "batch_size": cli.Range(int, low=1),
    "num_val": cli.Range(int, low=1),
    "val_anchors": cli.Range(int, low=1),
    "compare_prompts": cli.Range(int, low=0),
    "max_new_tokens": cli.Range(int, low=1),
    "seed": cli.Range(int, low=0),
}


def check_prune_args(values: dict) -> None:
    """Every flag of `train.py prune` in its range, and a stopping rule, before anything loads."""
    cli.check_ranges(values, PRUNE_RANGES)
    if values.get("min_layers") is None and values.get("tau_floor") is None:
        raise runtime.UserError(
            "train.py prune needs a stopping rule — give --min-layers N, --tau-floor F, or both"
        )
    if values.get("plot") is not None:
        evaluation.check_plotting()
    cli.check_drafter_folder("--drafter", values["drafter"])


@torch.no_grad()
def compare_drafters(target, drafters: dict, prompts, *, max_new_tokens: int, eos) -> dict:
    """Decode the same prompts with each drafter (sync and async) and with the target alone,
    in one run: tau and speedup (target-only time per token / speculative time per token,
    prefill excluded) per drafter and mode."""
    times = collections.defaultdict(float)
    tokens = collections.defaultdict(int)
    taus = collections.defaultdict(list)
    runs = [("target", None, "target")] + [
        (f"{name} {mode}", d, mode) for name, d in drafters.items() for mode in ("sync", "async")
    ]
    d3d.generate(target, None, prompts[0], max_new_tokens=4, mode="target")  # warm-up
    for ids in tqdm(prompts, desc="decode with each drafter", leave=False):
        for label, drafter, mode in runs:
            _, stats = d3d.generate(
                target, drafter, ids, max_new_tokens=max_new_tokens, mode=mode, eos_token_id=eos
            )
            times[label] += stats["time_total"] - stats["time_prefill"]
            tokens[label] += stats["num_new_tokens"] - 1
            taus[label].append(stats["tau"])
    base = times["target"] / max(tokens["target"], 1)
    return {
        label: {
            "speedup": base / (times[label] / max(tokens[label], 1)),
            "tau": sum(taus[label]) / len(taus[label]),
        }
        for label, _, _ in runs[1:]
    }


def describe_iteration(row: dict, recovery_steps: int, tau_floor: float | None, tau0: float) -> str:
    """What a row of d3d.prune_drafter says, in a line or two."""
    if row["removed_layer"] is None:
        return f"unpruned: {row['layers']} layers, tau {row['tau_after_recovery']:.3f}"
    tau = row["tau_after_recovery"]
    line = f"removed layer {row['removed_layer']}: {row['layers']} left, "
    line += f"tau {row['tau_before_recovery']:.3f}"
    if recovery_steps > 0:
        line += f" -> {tau:.3f} after recovery"
    line += f" ({row['seconds']:.0f} s, scoring {row['score_seconds']:.0f} s)"
    if row["recovery_skipped"]:
        line += (
            f"; recovery skipped {row['recovery_skipped']} of {recovery_steps} steps: "
            "gradient norm not finite"
        )
    if not row["kept"]:
        line += f"\ntau {tau:.3f} < {tau_floor} x {tau0:.3f}: removal undone, stopping"
    return line


def prune_main(
    *,
    drafter,
    out,
    min_layers,
    tau_floor,
    recovery_steps,
    lr,
    beta,
    batch_size,
    num_val,
    val_anchors,
    compare_prompts,
    max_new_tokens,
    dtype=None,
    gradient_checkpointing=None,
    device,
    seed,
    plot=None,
) -> dict:
    check_prune_args(dict(locals()))
    if device is None:
        device = "cpu"
        if torch.cuda.is_available():
            device = "cuda"
    device = torch.device(device)
    if out is None:
        out = drafter.rstrip("/") + "-pruned"
    if os.path.realpath(out) == os.path.realpath(drafter):
        raise runtime.UserError(f"--out {out} is the drafter being pruned — give another folder")
    # a GPU prunes in bf16 autocast like training; a CPU keeps exact fp32 (bf16 is slow on most)
    if dtype is None:
        dtype = "auto" if device.type == "cuda" else "float32"
    # activation checkpointing: by default on CUDA, off on a CPU
    checkpointing = gradient_checkpointing
    if checkpointing is None:
        checkpointing = device.type == "cuda"
    recipe, tokenizer, model, train, val, pad_id = evaluation.load_trained(drafter, device)
    max_len = recipe["max_len"]
    val_batches = [
        tuple(t.to(device) for t in answers.collate(val[s : s + batch_size], pad_id, max_len))
        for s in range(0, min(num_val, len(val)), batch_size)
    ]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    train_batches = [
        tuple(
            t.to(device)
            for t in answers.collate([train[i] for i in order[s : s + batch_size]], pad_id, max_len)
        )
        for s in range(0, len(order) - batch_size + 1, batch_size)
    ]
    # the unpruned drafter for the final comparison waits in host memory: on the device it
    # would sit beside the teacher copy prune_drafter makes
    unpruned = runtime.host_copy(model) if compare_prompts else None
    print(
        f"[prune] {drafter}: {model.model.config.num_hidden_layers} layers; "
        f"{len(val_batches)} validation and {len(train_batches)} recovery batches of "
        f"{batch_size}"
    )
    bf16 = runtime.resolve_dtype(dtype, device) == torch.bfloat16
    config = model.model.config.get_text_config()
    seq_len = (
        max((ids.shape[1] for ids, _ in train_batches), default=0)
        + val_anchors * model.d3d_config.block_size
    )
    estimate = memory.prune_memory_estimate(
        sum(p.numel() for p in model.parameters()),
        config.hidden_size,
        max(config.num_hidden_layers - 1, 1),  # recovery follows the first removal
        batch_size,
        seq_len,
        model.d3d_config.target_vocab_size,
        checkpointing,
        device.type,
    )
    print(
        f"[prune] estimated peak of a recovery step: {estimate['total']:.1f} GiB = "
        + ", ".join(f"{name} {gib:.1f}" for name, gib in estimate.items() if name != "total")
        + f" (activation checkpointing {'on' if checkpointing else 'off'}; the snapshot "
        "--tau-floor undoes to is kept on the CPU, not counted)"
    )
    # no cast cache: each use of a weight (the head, on the blocks and on the causal
    # stream) casts anew, so its recovery gradient sums in fp32, not in one cached bf16
    # copy
    with (
        torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
        if bf16
        else contextlib.nullcontext()
    ):
        table = []
        prune_config = d3d.PruneConfig(
            min_layers=min_layers,
            tau_floor=tau_floor,
            recovery_steps=recovery_steps,
            lr=lr,
            beta=beta,
            val_anchors=val_anchors,
            seed=seed,
            checkpointing=checkpointing,
        )
        rows = d3d.prune_drafter(
            model, val_batches, train_batches, prune_config, score=fast.tau_without_each_layer
        )
        for row in rows:
            table.append(row)
            for line in describe_iteration(
                row, recovery_steps, tau_floor, table[0]["tau_after_recovery"]
            ).split("\n"):
                tqdm.write(f"[prune] {line}")
    result = {
        "table": table,
        "drafter": os.path.abspath(drafter),
        "recovery_steps": recovery_steps,
        "beta": beta,
        "lr": lr,
        "dtype": "bfloat16" if bf16 else "float32",
        "num_val": min(num_val, len(val)),
        "val_anchors": val_anchors,
        "layer_ids": model.d3d_config.layer_ids,
        "checkpointing": checkpointing,
        "peak_memory_estimate_gib": round(estimate["total"], 2),
        "peak_memory_gib": round(memory.peak_memory_gib(device), 2),
    }
    if compare_prompts:
        target = runtime.load_causal_lm(recipe["target"], torch.float32, device).eval()
        prompts = [torch.tensor([p], device=device) for p, _ in val[:compare_prompts]]
        eos = getattr(target.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        drafters = {"unpruned": unpruned.to(device).eval(), "pruned": model.eval()}
        result["decode"] = compare_drafters(
            target, drafters, prompts, max_new_tokens=max_new_tokens, eos=eos
        )
    model.save_pretrained(out, tokenizer=tokenizer)
    with open(os.path.join(out, "train_args.json"), "w") as f:
        json.dump(
            {
                **recipe,
                "target": runtime.record_path(recipe["target"]),
                "pruned_from": runtime.record_path(drafter),
                "layer_ids": model.d3d_config.layer_ids,
            },
            f,
            indent=2,
        )
    with open(os.path.join(out, "prune_table.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"\n{'removed':>8}{'layers':>8}{'tau before':>12}{'tau after':>11}"
        f"{'% of tau0':>11}{'scoring s':>11}{'total s':>9}  (tau: offline, "
        f"B={model.d3d_config.block_size}, {result['num_val']} held-out answers x "
        f"{val_anchors} blocks, after recovery of {recovery_steps} steps)"
    )
    tau0 = table[0]["tau_after_recovery"]
    for row in table:
        removed = row["removed_layer"]
        if removed is None:
            removed = "-"
        line = f"{removed:>8}{row['layers']:>8}{row['tau_before_recovery']:>12.3f}"
        line += f"{row['tau_after_recovery']:>11.3f}"
        line += f"{100 * row['tau_after_recovery'] / tau0:>10.1f}%"
        line += f"{row['score_seconds']:>11.0f}{row['seconds']:>9.0f}"
        if not row["kept"]:
            line += "  (undone: below the floor)"
        print(line)
    for label, r in result.get("decode", {}).items():
        print(
            f"[decode] {label:<16} speedup {r['speedup']:.2f}x over target-only, tau {r['tau']:.2f}"
        )
    if plot is not None:
        path = pictures.draw_pruning_curve(plot, table, tau_floor=tau_floor)
        print(f"[done] pruning curve: {path}")
    print(
        f"[done] peak memory {result['peak_memory_gib']:.2f} GiB "
        f"({'GPU allocated' if device.type == 'cuda' else 'RSS'}; "
        f"estimated {estimate['total']:.2f})"
    )
    print(
        f"[done] pruned drafter ({model.model.config.num_hidden_layers} layers, original ids "
        f"{model.d3d_config.layer_ids}): {os.path.abspath(out)}; "
        f"table: {os.path.join(out, 'prune_table.json')}"
    )
    return result
