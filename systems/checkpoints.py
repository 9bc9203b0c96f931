"""What train.py keeps in a checkpoint to resume it, and the check that a rerun trains the same
recipe: `resume` loads a checkpoint that distributed.save_checkpoint (or, under FSDP,
save_sharded_checkpoint) wrote, after `check_resume` compared its recipe with the run's.
`s` everywhere: train.py's TrainSettings (out, resume, fsdp, rank, world, init)."""

from __future__ import annotations

import functools
import os
import random

import torch

import runtime
from systems import distributed


def resume(drafter, model, optimizer, scheduler, recipe: dict, s) -> tuple[int, int]:
    """Load the checkpoint in s.out (if s.resume and there is one): weights,
    AdamW, schedule, random states. Returns (first step, steps skipped so far)."""
    if not s.resume:
        return 0, 0
    check = functools.partial(check_resume, recipe=recipe, out=s.out)
    if s.fsdp:
        state = distributed.load_sharded_checkpoint(s.out, model, optimizer, check)
    else:
        check_not_sharded(s.out)
        state, optimizer_state = distributed.load_checkpoint(s.out)
        if state:
            check(state)
            drafter.load_state_dict(state["model"])
            if optimizer_state is not None:
                optimizer.load_state_dict(optimizer_state)
    if not state:
        return 0, 0
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    random.setstate(state["python_rng"])
    if s.rank == 0:
        path = state.get("path") or os.path.join(s.out, "checkpoint.pt")
        saved_by = ""
        if s.fsdp:
            saved_by = f" (saved by {state['world']} processes, resumed by {s.world})"
        print(f"[train] resumed from {path} at step {state['step']}{saved_by}")
    return state["step"], state.get("skipped", 0)


def check_not_sharded(out: str) -> None:
    """A run without --fsdp refuses a folder that holds only an --fsdp checkpoint."""
    if os.path.exists(os.path.join(out, "checkpoint.pt")):
        return
    if os.path.isdir(os.path.join(out, distributed.SHARDED_CHECKPOINT)):
        raise runtime.UserError(
            f"{out} holds a checkpoint of an --fsdp run "
            f"({distributed.SHARDED_CHECKPOINT}): resume it with --fsdp "
            "(any number of processes), or start afresh with --no-resume"
        )


# What shapes a drafter and its data, kept in every checkpoint; the flag that sets each
RECIPE_FLAGS = {
    "init": "--drafter-init",
    "layer_ids": "--drafter-layers",
    "block_size": "--block-size",
    "num_anchors": "--num-anchors",
    "ar_weight": "--ar-weight",
    "decay_gamma": "--decay-gamma",
    "d1_from": "--d1-from",
    "tokenizer": "--target (its tokenizer)",
}


def recipe_of(drafter, s) -> dict:
    """The settings a checkpoint was trained with (RECIPE_FLAGS), as plain values."""
    config = drafter.d3d_config
    return {
        "init": s.init,
        "layer_ids": config.layer_ids,
        "block_size": config.block_size,
        "num_anchors": config.num_anchors,
        "ar_weight": config.ar_weight,
        "decay_gamma": config.decay_gamma,
        "d1_from": config.d1_from,
        "tokenizer": config.tokenizer_hash,
    }


def check_resume(saved: dict, recipe: dict, out: str) -> None:
    """Refuse to resume a checkpoint trained with other settings: say which one differs."""
    fresh = "start fresh with --no-resume, or give another --out"
    if "recipe" not in saved:
        message = f"--out {out} holds a checkpoint that records no recipe — {fresh}"
        raise runtime.UserError(message)
    for key, value in recipe.items():
        before = saved["recipe"].get(key)
        if before != value:
            raise runtime.UserError(
                f"--out {out} holds a checkpoint trained with {RECIPE_FLAGS[key]} = "
                f"{before!r}, this run asks for {value!r} — rerun with the same "
                f"setting to resume, or {fresh}"
            )
