"""What train.py keeps in a checkpoint to resume it, the check that a rerun trains the same
recipe, and the signals that stop a run without losing its work: `save` writes a checkpoint
(distributed.save_checkpoint, or under FSDP save_sharded_checkpoint) and `resume` loads it,
after `check_resume` compared its recipe with the run's; `StopSignals` turns SIGINT and SIGTERM
into a stop at the end of the step in progress, which train.py saves and ends with
`Interrupted` and the line `stopped` writes: the command that goes on.
`s` everywhere: train.py's TrainSettings (out, resume, fsdp, rank, world, init, ...)."""

from __future__ import annotations

import array
import functools
import hashlib
import json
import os
import random
import shlex
import signal
import sys

import torch
from tqdm.auto import tqdm

import runtime
from systems import distributed


def resume(drafter, model, optimizer, scheduler, recipe: dict, s) -> tuple[int, int]:
    """Load the checkpoint in s.out (if s.resume and there is one): weights,
    AdamW, schedule, random states. Returns (first step, steps skipped so far)."""
    if not s.resume:
        if s.rank == 0:
            print(f"[train] --no-resume: starting from step 0 (the first save replaces {s.out}'s)")
        return 0, 0
    check = functools.partial(check_resume, recipe=recipe, out=s.out)
    if s.fsdp:
        state = distributed.load_sharded_checkpoint(s.out, model, optimizer, check)
    else:
        state, optimizer_state = distributed.load_checkpoint(s.out)
        if state:
            check(state)
            drafter.load_state_dict(state["model"])
            if optimizer_state is not None:
                optimizer.load_state_dict(optimizer_state)
    if not state:
        if s.rank == 0:
            print(f"[train] no checkpoint in {s.out}: starting from step 0")
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


# What shapes a drafter and its data, kept in every checkpoint; the flag that sets each. Not in
# it: --steps (a rerun with more extends the run), the held-out settings, where and in what
# dtype the run computes, and under --fsdp the number of processes (the data order then
# follows the new sharding)
RECIPE_FLAGS = {
    # the drafter
    "init": "--drafter-init",
    "random_init": "--random-init",
    "layer_ids": "--drafter-layers",
    "block_size": "--block-size",
    "num_anchors": "--num-anchors",
    "ar_weight": "--ar-weight",
    "decay_gamma": "--decay-gamma",
    "d1_from": "--d1-from",
    "tokenizer": "--target (its tokenizer)",
    "freeze_embeddings": "--freeze-embeddings",
    # the data, and the order it comes in
    "answers": "the training answers (--target, --prompts, --prompt-field, --num-prompts, "
    "--val-fraction, --num-val, --max-new-tokens, --thinking)",
    "max_len": "--max-len",
    "batch_size": "--batch-size",
    "grad_accum": "--grad-accum",
    "seed": "--seed",
    # the optimizer and its schedule
    "lr": "--lr",
    "warmup": "--warmup",
    "weight_decay": "--weight-decay",
    "grad_clip": "--grad-clip",
}


def recipe_of(drafter, train: list, s) -> dict:
    """The settings a checkpoint was trained with (RECIPE_FLAGS), as plain values: the
    method's from the drafter's D3DConfig, the tokenizer's fingerprint, the training answers
    `train` as theirs (answers_fingerprint), the rest from `s`."""
    config = drafter.d3d_config
    recipe = {}
    for key in RECIPE_FLAGS:
        if hasattr(config, key):
            recipe[key] = getattr(config, key)
        elif key == "tokenizer":
            recipe[key] = config.tokenizer_hash
        elif key == "answers":
            recipe[key] = answers_fingerprint(train)
        else:
            recipe[key] = getattr(s, key)
    return recipe


def answers_fingerprint(train: list) -> str:
    """A short hash of the training examples, (prompt ids, response ids) each, in order."""
    digest = hashlib.sha256()
    for prompt, response in train:
        for ids in (prompt, response):
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(array.array("q", ids).tobytes())
    return digest.hexdigest()[:16]


def check_resume(saved: dict, recipe: dict, out: str) -> None:
    """Refuse to resume a checkpoint trained with other settings: say which one differs."""
    fresh = "start fresh with --no-resume, or give another --out"
    if "recipe" not in saved:
        message = f"--out {out} holds a checkpoint that records no recipe — {fresh}"
        raise runtime.UserError(message)
    for key, value in recipe.items():
        if key not in saved["recipe"]:
            raise runtime.UserError(
                f"--out {out} holds a checkpoint that records no {RECIPE_FLAGS[key]} — {fresh}"
            )
        before = saved["recipe"][key]
        if before != value:
            raise runtime.UserError(
                f"--out {out} holds a checkpoint trained with {RECIPE_FLAGS[key]} = "
                f"{before!r}, this run asks for {value!r} — rerun with the same "
                f"setting to resume, or {fresh}"
            )


def report_finished(s, step: int, block_size: int) -> None:
    """What a rerun of a finished training found (rank 0): the step and the offline tau its
    train_args.json holds (none there: the run stopped before its drafter was saved)."""
    if s.rank > 0:
        return
    path = os.path.join(s.out, "train_args.json")
    found = "no train_args.json yet"
    if os.path.isfile(path):
        with open(path) as f:
            record = json.load(f)
        if record.get("steps") == step and record.get("offline_tau") is not None:
            tau = record["offline_tau"]
            found = f"offline tau (B={block_size}) {tau:.3f} in train_args.json"
    print(
        f"[train] {s.out} holds a finished run of {step} steps ({found}): nothing to train, "
        "the held-out answers are measured again — more --steps trains on"
    )


def save(drafter, model, optimizer, scheduler, done, skipped, recipe, s) -> None:
    """A checkpoint after `done` steps: under FSDP every process writes its
    shards (distributed.save_sharded_checkpoint), else rank 0 alone."""
    state = {"scheduler": scheduler.state_dict(), "skipped": skipped, "recipe": recipe}
    if s.fsdp:
        distributed.save_sharded_checkpoint(s.out, done, model, optimizer, state)
    elif s.rank == 0:
        state["model"] = drafter.state_dict()
        state["rng"] = torch.get_rng_state()
        state["python_rng"] = random.getstate()
        distributed.save_checkpoint(s.out, done, state, optimizer.state_dict())


# ---------------------------------------------------------------------------------------------
# Stopping at a step boundary


class Interrupted(KeyboardInterrupt):
    """Training stopped by SIGINT or SIGTERM at the end of a step, its checkpoint saved: the
    message is the one line that says so (the step, where, the command that goes on)."""


class StopSignals:
    """Inside `with StopSignals() as stop:`, SIGINT (Ctrl-C) and SIGTERM (a scheduler's kill)
    do not kill the run: they set stop.name, and the loop asks `stop.agreed(...)` at each step
    boundary. A second signal stops at once (KeyboardInterrupt): the last checkpoint stays
    whole, since every piece is written, then renamed. A signal the process ignores stays
    ignored (a shell's background job ignores SIGINT: Ctrl-C is not meant for it); outside the
    main thread (where Python takes no signal handler) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.name = None
        self.before = {}

    def __enter__(self) -> "StopSignals":
        try:
            for number in self.SIGNALS:
                if signal.getsignal(number) is not signal.SIG_IGN:
                    self.before[number] = signal.signal(number, self.ask)
        except ValueError:
            # not the main thread: the signals keep their handlers
            self.before = {}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.before.items():
            signal.signal(number, handler)

    def ask(self, number: int, frame) -> None:
        """The handler: the first signal asks for a stop, a second one raises."""
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(number).name

    def agreed(self, world: int, device) -> bool:
        """Whether to stop now: on several processes, if any of them was signalled
        (distributed.any_rank), so that all save at the same step."""
        asked = self.name is not None
        if world > 1:
            return distributed.any_rank(asked, device)
        return asked


def stopped(name: str | None, done: int, s) -> str:
    """The line a stopped run ends with (rank 0 prints it): the signal (None: another
    process's), the step, the checkpoint, the command that goes on."""
    if name is None:
        name = "another process's signal"
    where = os.path.join(s.out, "checkpoint.pt")
    if s.fsdp:
        where = os.path.join(s.out, distributed.SHARDED_CHECKPOINT)
    line = f"[train] {name}: stopped after step {done} of {s.steps}, saved in {where}"
    line += f"; go on with: {go_on_command(s)}"
    if s.rank == 0:
        tqdm.write(line)
    return line


def go_on_command(s) -> str:
    """The command that resumes this run: the one that started it, without --no-resume."""
    argv = sys.argv
    if not argv[0].endswith("train.py"):
        # called in-process
        return f"train.main(out={s.out!r}, ...) with the same settings"
    argv = [a for a in argv if a != "--no-resume"]
    launcher = "python"
    if s.world > 1:
        launcher = f"torchrun --nproc_per_node={s.world}"
    return f"{launcher} {shlex.join(argv)}"
