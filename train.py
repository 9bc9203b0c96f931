"""Train a D3D drafter on answers written by the target itself (paper "Drafter training", Fig. 1a).

    python train.py                   # the built-in toy on CPU, no download: runs/toy/drafter
    python train.py --plot acc.png    # and its block accuracy by position, drawn at the end
    python train.py --seed 1 --ar-weight 0 --d1-from mask --out runs/lab/lam0  # LAB.md
    python train.py --target PATH --prompts train.jsonl --val-prompts test.jsonl \
        --drafter-layers 8 ...
    torchrun --nproc_per_node=N train.py ...         # DDP; data sharded by rank
    torchrun --nproc_per_node=N train.py ... --fsdp  # FSDP2: a drafter > 1 GPU
    python train.py prune --drafter runs/toy/drafter --min-layers 1  # pruning (Fig. 1b)
    python train.py eval --drafter runs/toy/drafter  # offline tau on held-out answers

1. data: the target answers the prompts greedily (chat template, thinking off); prompt
   and response token ids are cached as JSON Lines (a header naming the target and its
   tokenizer, then one line per prompt), so a rerun or an interrupted run only answers
   what is missing. The toy ships its target's answers (toy-target/, see toy.py).
2. drafter: any causal LM with the target's tokenizer (--drafter-init, default the
   target), keeping some layers.
3. training (train_drafter): AdamW on L_block + lambda * L_AR (d3d.d3d_loss), offline
   tau on held-out prompts (d3d.offline_tau), checkpoints that a rerun resumes from; the
   final drafter folder holds train_args.json naming its target.
4. pruning (`prune`): d3d.prune_drafter on the same cached answers, then the pruned and
   unpruned drafters decode the same held-out prompts against the target in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

import d3d
import runtime
import toy
from runtime import Range
from systems import answers, checkpoints, cli, distributed, evaluation, memory, pruning, train_flags

# the drafter: a pretrained causal LM with the target's tokenizer, some of its layers kept
from systems.drafters import build_drafter, freeze_embeddings, select_layers  # noqa: F401

# steps in a row with a non-finite gradient before training stops: the run has diverged
MAX_SKIPPED_IN_A_ROW = 5


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainSettings:
    """What train_drafter needs besides the drafter and its data: the training flags (each
    field with a help is one), then what main works out from the run."""

    out: str = cli.flag(
        "runs/toy/drafter", "drafter folder: checkpoints go here, and a rerun resumes from them"
    )
    steps: int = cli.flag(400, "optimizer steps", Range(int, low=1))
    batch_size: int = cli.flag(8, "sequences per micro-batch and rank", Range(int, low=1))
    grad_accum: int = cli.flag(1, "micro-batches per optimizer step", Range(int, low=1))
    lr: float = cli.flag(1e-3, "peak learning rate", Range(float, low=0, low_open=True))
    warmup: int = cli.flag(
        20, "linear warmup steps, then cosine to 10 % (get_lr)", Range(int, low=0)
    )
    weight_decay: float = cli.flag(
        0.0,
        "AdamW weight decay, on every trained weight but a frozen embedding",
        Range(float, low=0),
    )
    grad_clip: float = cli.flag(1.0, "max gradient norm", Range(float, low=0, low_open=True))
    freeze_embeddings: bool = cli.flag(
        False,
        "freeze embeddings and lm_head except the MASK row (default: train them)",
        Range(bool),
    )
    max_len: int = cli.flag(1024, "cut sequences to this many tokens", Range(int, low=2))
    eval_every: int = cli.flag(100, "offline tau every N steps", Range(int, low=1))
    val_anchors: int = cli.flag(32, "blocks per held-out answer for tau", Range(int, low=1))
    save_every: int = cli.flag(100, "checkpoint every N steps", Range(int, low=1))
    seed: int = cli.flag(0, "data order and anchors", Range(int, low=0))
    resume: bool = cli.flag(
        True, "ignore out/checkpoint.pt", Range(bool), flag="--no-resume", action="store_false"
    )
    force: bool = cli.flag(
        False,
        "write --out and --plot over what train.py did not write there (a model, another "
        "command's run, other files); the repository's toy-target/ never (default: refuse, "
        "before anything loads)",
        Range(bool),
    )
    fsdp: bool = cli.flag(
        False,
        "shard fp32 weights, gradients and AdamW moments over the processes "
        "(FSDP2, per decoder layer and root; bf16 by FSDP's mixed precision: layers "
        "gathered in bf16, gradients reduced in fp32). Use it when 16 bytes a "
        "parameter do not fit one GPU (the Qwen3-8B drafter: RESULTS.md, FSDP "
        "memory); else plain torchrun (DDP) is simpler and faster. Rank 0 alone "
        "reads the drafter's weights (one host copy, not one a process) and "
        "broadcasts them into the shards. Checkpoints: OUT/checkpoint-fsdp, one "
        "file a process, resumed by any number of processes (with another number "
        "the data order follows the new sharding). Without torchrun: FSDP on one "
        "process (default: off)",
        Range(bool),
    )
    # what main works out: the pad id, bfloat16 compute (fp32 master weights), this process
    pad_id: int = 0
    bf16: bool = False
    rank: int = 0
    world: int = 1
    # where to train (a rank > 0 under fsdp holds the drafter on the meta device until
    # distributed.shard_model fills its shards)
    device: torch.device = torch.device("cpu")
    # the checkpoint the drafter started from, and whether its weights were drawn afresh
    # (--random-init): kept in the recipe (checkpoints.recipe_of)
    init: str = ""
    random_init: bool = False


def train_drafter(drafter: d3d.Drafter, train, val, s: TrainSettings) -> dict:
    """AdamW on d3d_loss (L_block + lambda L_AR), the rate from get_lr.

    Checkpoints every s.save_every steps and resumes from them. SIGINT (Ctrl-C) or
    SIGTERM stops it at the end of the step in progress, on every process alike:
    that step is saved, and checkpoints.Interrupted carries the line that says how
    to go on. With s.fsdp the drafter is sharded in place and returned as "sharded"
    (its FSDP root) with the result; every process then evaluates and saves."""
    # bf16 autocast in training and evaluation alike; FSDP casts to bf16 itself
    # (distributed.shard_model)
    held_out = held_out_of(s, s.bf16 and not s.fsdp)
    model, frozen = wrap_for_training(drafter, s)
    optimizer = make_optimizer(drafter, frozen, s)
    scheduler = make_scheduler(optimizer, s)
    recipe = checkpoints.recipe_of(drafter, train, s)
    start_step, skipped = checkpoints.resume(drafter, model, optimizer, scheduler, recipe, s)
    if start_step >= s.steps:
        checkpoints.report_finished(s, start_step, drafter.d3d_config.block_size)
    batches = MicroBatches(train, s)
    tally = Tally(skipped=skipped)
    start = time.perf_counter()
    drafter.train()
    bar = progress_bar(start_step, s)
    # SIGINT and SIGTERM stop the loop at the end of the step in progress, which is saved
    with checkpoints.StopSignals() as stop:
        for step in bar:
            step_start = time.perf_counter()
            stepped, loss, metrics, num_tokens = train_step(
                model, optimizer, scheduler, batches, step, held_out.autocast
            )
            tally.count(step, stepped, loss)
            tokens_per_s = num_tokens * s.world / (time.perf_counter() - step_start)
            show_progress(bar, metrics, tally, tokens_per_s, s.device)
            done = step + 1
            if done % s.eval_every == 0 and done < s.steps:
                evaluate(drafter, val, held_out, model, done, tally, s)
            # every process alike: all save the same step
            stopping = stop.agreed(s.world, s.device)
            if done % s.save_every == 0 or done == s.steps or stopping:
                checkpoints.save(
                    drafter, model, optimizer, scheduler, done, tally.skipped, recipe, s
                )
            if stopping:
                bar.close()
                raise checkpoints.Interrupted(checkpoints.stopped(stop.name, done, s))
    bar.close()
    # also when a rerun finds the run finished: evaluates with the new --num-val, ...
    evaluate(drafter, val, held_out, model, s.steps, tally, s)
    result = {
        "offline_tau": tally.tau,
        "history": tally.history,
        "skipped_steps": tally.skipped,
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    if s.fsdp:
        result["sharded"] = model
    return result


def train_step(model, optimizer, scheduler, batches: MicroBatches, step: int, autocast):
    """One optimizer step: the loss and backward of s.grad_accum micro-batches, then AdamW
    unless the gradient is not finite, and the next rate. Returns (whether AdamW stepped,
    the last micro-batch's loss and metrics, the tokens this process trained on)."""
    s = batches.s
    num_tokens = 0
    for a in range(s.grad_accum):
        input_ids, loss_mask = batches(step * s.grad_accum + a)
        num_tokens += int((input_ids != s.pad_id).sum())
        last = a == s.grad_accum - 1
        with gradient_sync(model, s, last):
            with autocast():
                # loss, metrics = d3d.d3d_loss(drafter, input_ids, loss_mask, generator=...)
                # run in the forward of `model`, which DDP and FSDP wrap (TrainingLoss);
                # K, B, lambda and gamma from the drafter's config
                loss, metrics = model(
                    d3d.d3d_loss, input_ids, loss_mask, generator=batches.anchors_rng
                )
            (loss / s.grad_accum).backward()
    # a NaN or Inf gradient never reaches AdamW: the step is skipped
    stepped = runtime.finite_step(optimizer, model.parameters(), s.grad_clip)
    # on a skipped step too: the rate stays a function of the step, as a resume assumes
    scheduler.step()
    return stepped, loss, metrics, num_tokens


@dataclass
class Tally:
    """What the loop counts: the running mean of the loss (for the progress bar), the steps
    skipped for a non-finite gradient (in all and in a row), the evaluations so far."""

    skipped: int = 0
    skipped_in_a_row: int = 0
    loss_ema: float | None = None
    tau: float = float("nan")
    history: list = field(default_factory=list)

    def count(self, step: int, stepped: bool, loss: torch.Tensor) -> None:
        """A step that stepped adds its loss to the running mean (0.9 old, 0.1 new); one that
        did not is skipped, and MAX_SKIPPED_IN_A_ROW of them in a row stop the run."""
        if stepped:
            self.skipped_in_a_row = 0
            # only here: a NaN loss would stay in the running mean for good
            if self.loss_ema is None:
                self.loss_ema = loss.item()
            else:
                self.loss_ema = 0.9 * self.loss_ema + 0.1 * loss.item()
            return
        self.skipped_in_a_row += 1
        self.skipped += 1
        if self.skipped_in_a_row < MAX_SKIPPED_IN_A_ROW:
            return
        raise RuntimeError(
            f"step {step + 1}: {self.skipped_in_a_row} steps in a row had a non-finite "
            f"gradient ({self.skipped} skipped in all); training has diverged. Lower "
            "--lr, use --dtype float32, or check the data for empty or corrupt answers"
        )


def held_out_of(s: TrainSettings, bf16: bool) -> evaluation.HeldOut:
    """How offline tau measures the held-out answers: --val-anchors blocks each, cut at
    --max-len, in bfloat16 autocast if `bf16`."""
    autocast = evaluation.bf16_autocast(s.device, bf16)
    return evaluation.HeldOut(s.pad_id, s.max_len, s.val_anchors, autocast)


def get_lr(step: int, warmup: int, steps: int) -> float:
    """The learning rate at `step` as a share of the peak (nanoGPT's get_lr)."""
    # 1) linear warmup: (step + 1) / warmup of the peak, then the whole peak
    ramp = min(1.0, (step + 1) / max(warmup, 1))
    # 2) cosine decay over the whole run: 1 at step 0 down to 0.1 at `steps`
    progress = min(step / steps, 1)
    decay = 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    # 3) the warmup ramps the start of the cosine
    return ramp * decay


def make_scheduler(optimizer, s: TrainSettings):
    """LambdaLR: the optimizer's rate is lr x get_lr(step)."""
    share_of_peak = functools.partial(get_lr, warmup=s.warmup, steps=s.steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, share_of_peak)


def wrap_for_training(drafter: d3d.Drafter, s: TrainSettings):
    """The drafter's loss as a module, sharded (FSDP2) or wrapped in DDP on
    several processes; embeddings frozen if s.freeze. Returns (model, the
    frozen embedding weight or None)."""
    frozen = None
    if s.freeze_embeddings:
        frozen, keep = freeze_embeddings(drafter, hook=not s.fsdp, device=s.device)
    model = TrainingLoss(drafter)
    if s.fsdp:
        layers = drafter.model.get_decoder().layers
        distributed.shard_model(model, layers, s.bf16, s.device)
        if s.freeze_embeddings:
            # fully_shard replaced the parameter, dropping the hooks of the old one
            frozen = drafter.model.get_input_embeddings().weight
            distributed.freeze_sharded_rows(frozen, keep)
    elif s.world > 1:
        # PyTorch's own DDP: gradients all-reduced in backward
        device_ids = None
        if s.device.type == "cuda":
            device_ids = [s.device]
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return model, frozen


def make_optimizer(drafter: d3d.Drafter, frozen, s: TrainSettings):
    """AdamW, betas (0.9, 0.95): weight decay on every trained weight; none
    on a frozen embedding (its MASK row trains, the rest stays)."""
    decayed = [p for p in drafter.parameters() if p.requires_grad and p is not frozen]
    groups = [{"params": decayed, "weight_decay": s.weight_decay}]
    if frozen is not None:
        groups.append({"params": [frozen], "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95))


class MicroBatches:
    """This rank's micro-batches: batches(m) is the m-th, a function of m only
    (data order and anchors seeded by m), so a resume continues exactly."""

    def __init__(self, train, s: TrainSettings):
        self.shard = train[s.rank :: s.world]  # each rank its own sequences
        self.per_epoch = math.ceil(len(self.shard) / s.batch_size)
        self.s = s
        # draws the anchors of the micro-batch (d3d_loss's generator)
        self.anchors_rng = torch.Generator()

    def __call__(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        epoch, k = divmod(m, self.per_epoch)
        order_rng = torch.Generator().manual_seed(s.seed * 7919 + epoch)
        order = torch.randperm(len(self.shard), generator=order_rng).tolist()
        self.anchors_rng.manual_seed((s.seed * 1_000_003 + m) * s.world + s.rank)
        chosen = order[k * s.batch_size : (k + 1) * s.batch_size]
        examples = [self.shard[i] for i in chosen]
        input_ids, loss_mask = answers.collate(examples, s.pad_id, s.max_len)
        return input_ids.to(s.device), loss_mask.to(s.device)


def gradient_sync(model, s: TrainSettings, last: bool):
    """DDP all-reduces once per step: no_sync on every micro-batch but the
    last. FSDP reduce-scatters every micro-batch: skipping it would keep whole
    unsharded gradients between micro-batches, the memory sharding saves."""
    if s.world > 1 and not s.fsdp and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def progress_bar(start_step: int, s: TrainSettings):
    """tqdm over the steps left; rank 0's only."""
    return tqdm(
        range(start_step, s.steps),
        initial=start_step,
        total=s.steps,
        desc="train drafter",
        disable=s.rank > 0,
    )


def show_progress(bar, metrics: dict, tally: Tally, tokens_per_s: float, device) -> None:
    """The step's numbers on the progress bar: running loss, the two terms,
    block accuracy (mean, and d1_acc: d_1's, read where decoding reads it),
    tokens per second, peak memory."""
    bar.set_postfix(
        loss=f"{tally.loss_ema or float('nan'):.3f}",
        block=f"{metrics['loss_block']:.2f}",
        ar=f"{metrics['loss_ar']:.2f}",
        block_acc=f"{metrics['block_acc'].mean():.3f}",
        d1_acc=f"{metrics['block_acc'][0]:.2f}",
        tok_per_s=f"{tokens_per_s:.0f}",
        # CUDA: this step's peak; CPU: the run's
        peak_gib=f"{memory.peak_memory_gib(device, reset=True):.2f}",
        skipped=tally.skipped,
    )


def evaluate(drafter, val, held_out, model, done: int, tally: Tally, s: TrainSettings) -> None:
    """Offline tau on the held-out answers after `done` steps (evaluation.evaluate_tau): printed
    (rank 0), and a row of tally.history. Rank 0 evaluates, or every rank under FSDP (each
    pass goes through the sharded root); nothing does without held-out data."""
    if not val or (s.rank > 0 and not s.fsdp):
        return
    sharded = None
    if s.fsdp:
        sharded = model
    tally.tau = evaluation.evaluate_tau(drafter, val, held_out, sharded=sharded)
    loss = None
    line = f"[train] step {done}: "
    # a rerun of a finished run trains no step: it has no loss to show
    if tally.loss_ema is not None:
        loss = round(tally.loss_ema, 4)
        line += f"loss {tally.loss_ema:.3f}, "
    line += f"offline tau (B={drafter.d3d_config.block_size}) {tally.tau:.3f}"
    if tally.skipped:
        line += f", {tally.skipped} steps skipped (non-finite gradient)"
    if s.rank == 0:
        tqdm.write(line)
    row = {"step": done, "loss": loss, "offline_tau": round(tally.tau, 3)}
    tally.history.append({**row, "skipped": tally.skipped})


class TrainingLoss(torch.nn.Module):
    """model(fn, *args) is fn(drafter, *args): d3d.d3d_loss (or offline_tau) run in a module's
    forward. DDP prepares its gradient all-reduce in the forward of the module it wraps, and
    FSDP gathers its root's weights there; d3d_loss calls the drafter's hidden_states and
    projects the labelled rows itself, so DDP and FSDP wrap this, and the loop names the
    function it runs."""

    def __init__(self, drafter: d3d.Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, fn, *args, **settings):
        return fn(self.drafter, *args, **settings)


# ---------------------------------------------------------------------------------------------
# Command line: the flags of train_flags' dataclasses, d3d.D3DConfig's and TrainSettings'

# Zero is legal where it means something: --seed 0, --warmup 0 (no warmup), --ar-weight 0
# (Table 3's lambda = 0), --weight-decay 0.
GROUPS = {
    "data": train_flags.DataSettings,
    "drafter": train_flags.DrafterSettings,
    "the method (d3d.D3DConfig, saved as the drafter's d3d_config.json)": (
        d3d.D3DConfig,
        train_flags.NOT_FLAGS,
    ),
    "training (TrainSettings)": TrainSettings,
    "run": train_flags.RunSettings,
}
RANGES, _ = cli.flag_ranges(GROUPS)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `python train.py`, a group per settings dataclass, as --help shows them."""
    ap = cli.Parser(description=__doc__.split("\n\n")[0])
    later = {}
    for name, toy_value in train_flags.TOY_DEFAULTS.items():
        value = train_flags.DEFAULTS.get(name, "torch's choice")
        later[name] = f"{value}; {toy_value} for the toy"
    cli.add_groups(ap, GROUPS, later=later, defaults={"toy": toy.SHIPPED})
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Every flag in its range, every file it names readable and every path it writes free to
    write (cli.check_output), before anything loads: a bad value raises runtime.UserError (one
    line), never a traceback halfway through a run."""
    cli.check_flags(vars(args), GROUPS)
    train_flags.check_inputs(args)
    # what the run writes: a training run's folder, a picture, answer caches
    cli.check_output("--out", args.out, cli.TRAINING_RUN, args.force)
    cli.check_output("--plot", args.plot, cli.PICTURE, args.force)
    cli.check_not_toy_target("--data-dir", args.data_dir)


# ---------------------------------------------------------------------------------------------
# The run: load -> train -> save and print


def main(**overrides) -> dict:
    """Run the whole recipe. Keyword arguments are the command-line flags (snake_case);
    defaults as there."""
    args = train_flags.given(parse_args, overrides)
    check_args(args)
    toy_run = args.target is None
    paths = None
    if toy_run:
        paths = toy.open_toy(args.toy)
    train_flags.fill_defaults(args, toy_run)
    device = runtime.resolve_device(args.device)
    device, rank, world = distributed.start_process_group(device, args.fsdp, args.dist_timeout)
    if toy_run and args.dtype == "auto":
        # the toy's tiny models: bf16 would buy nothing and round more
        args.dtype = "float32"
    bf16 = runtime.resolve_dtype(args.dtype, device) == torch.bfloat16
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    inputs = train_flags.inputs_of(args, paths, rank)
    tokenizer = runtime.load_tokenizer(inputs.target)
    dtype = torch.bfloat16 if bf16 else None
    train, val = train_flags.load_answers(
        inputs, vars(args), tokenizer, device=device, dtype=dtype, rank=rank, world=world
    )

    drafter, init = load_drafter(args, inputs, tokenizer, device, rank)
    if rank == 0:
        describe_drafter(args, drafter, init, len(train), len(val))
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    where = dict(pad_id=pad_id, bf16=bf16, rank=rank, world=world, device=device)
    init = runtime.record_path(init)
    settings = cli.settings_of(
        TrainSettings, vars(args), init=init, random_init=args.random_init, **where
    )
    memory.check_training_size(drafter, train, val, settings)
    # everything is loaded and checked: the loop starts
    result = train_drafter(drafter, train, val, settings)

    peak = memory.peak_memory_gib(device)
    drafter, other = measure_the_other_d1(drafter, val, result, settings)
    if rank == 0:
        save_drafter(args, inputs, drafter, tokenizer, val, result, settings, peak)
        print_done(args, inputs, result, other, len(val), peak, device)
    distributed.end_process_group()
    return {**result, "drafter": drafter, "out": args.out}


def load_drafter(args, inputs, tokenizer, device, rank: int) -> tuple[d3d.Drafter, str]:
    """(the drafter build_drafter makes from the flags, on `device`; the checkpoint it starts
    from). Under FSDP rank 0 alone reads the weights, the others get shards
    (distributed.shard_model)."""
    config = runtime.from_local_or_hub(AutoConfig.from_pretrained, inputs.target, "--target")
    target_config = config.get_text_config()
    on_meta = args.fsdp and rank > 0
    init = args.drafter_init or inputs.target
    # B, K, lambda, gamma and d1_from: the flags of d3d.D3DConfig
    fields = cli.flag_fields(d3d.D3DConfig, train_flags.NOT_FLAGS)
    method = {f.name: getattr(args, f.name) for f in fields}
    drafter = build_drafter(
        init,
        tokenizer,
        target_vocab_size=target_config.vocab_size,
        layers=inputs.layers,
        random_init=args.random_init,
        meta=on_meta,
        **method,
    )
    if not on_meta:
        drafter.to(device)
    if args.gradient_checkpointing:
        drafter.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    return drafter, init


def measure_the_other_d1(drafter, val, result: dict, s: TrainSettings):
    """The same held-out blocks with d_1 drafted by MASK 1 instead of the causal row, or the
    reverse (result["offline_tau_d1_from_..."]). Returns (the drafter, whole: gathered from
    its shards under FSDP, in the dtype it was trained in; the other d1_from)."""
    other = evaluation.OTHER_D1[drafter.d3d_config.d1_from]
    key = f"offline_tau_d1_from_{other}"
    # bf16 autocast as in training: FSDP's sharded passes cast themselves
    held_out = held_out_of(s, s.bf16 and not s.fsdp)
    sharded = result.pop("sharded", None)
    if sharded is not None:
        # every rank evaluates the sharded drafter, then all gather it once, onto rank 0's host
        result[key] = evaluation.evaluate_tau(
            drafter, val, held_out, sharded=sharded, d1_from=other
        )
        # ranks > 0 keep their shards
        drafter = distributed.gather_drafter(sharded, drafter) or drafter
    if s.bf16 and (s.rank == 0 or sharded is None):
        # the final drafter in the dtype it was trained in (the fp32 master weights stay in
        # the checkpoint)
        drafter.model.to(torch.bfloat16)
    if s.rank == 0 and sharded is None:
        result[key] = evaluation.evaluate_tau(drafter, val, held_out, d1_from=other)
    return drafter, other


def save_drafter(args, inputs, drafter, tokenizer, val, result: dict, s: TrainSettings, peak):
    """The final drafter folder: the drafter, its curve (--plot), train_args.json: the flags,
    the files read (the toy's relative to the repository, a user's as given:
    runtime.record_path), the result and where it ran."""
    if args.plot is not None:
        title = f"{args.out}: held-out blocks with d_1 .. d_i all accepted"
        held_out = held_out_of(s, s.bf16)
        result["curve"] = evaluation.plot_curves(args.plot, drafter, val, held_out, title)
    drafter.save_pretrained(args.out, tokenizer=tokenizer)
    record = {
        **vars(args),
        "toy": runtime.record_path(args.toy),
        **inputs.recorded(),
        "layer_ids": drafter.d3d_config.layer_ids,
        **result,
        "peak_memory_gib": round(peak, 2),
        "device": str(s.device),
        "world_size": s.world,
        "compute_dtype": "bfloat16" if s.bf16 else "float32",
        "fsdp": args.fsdp,
    }
    with open(os.path.join(args.out, "train_args.json"), "w") as f:
        json.dump(record, f, indent=2)


def describe_drafter(args, drafter: d3d.Drafter, init: str, num_train: int, num_val: int):
    """One line on the drafter and the data, and a note if lambda = 0 leaves d_1 untrained."""
    params = sum(p.numel() for p in drafter.parameters())
    if args.random_init:
        init += " (random weights)"
    print(
        f"[drafter] {init}, layers {drafter.d3d_config.layer_ids or 'all'}, "
        f"{params / 1e6:.1f}M parameters; {num_train} training and {num_val} "
        "held-out answers"
    )
    if args.ar_weight == 0 and args.d1_from == "causal":
        print(
            "[drafter] note: --ar-weight 0 trains no next-token head, yet d_1 comes from "
            "it (--d1-from causal); --d1-from mask drafts d_1 from MASK 1, which the "
            "block loss does train"
        )


def print_done(args, inputs, result: dict, other: str, num_val: int, peak, device):
    """The closing lines: tau both ways, time, memory, and where everything went."""
    memory_kind = "RSS"
    if device.type == "cuda":
        memory_kind = "GPU allocated"
    print(
        f"[done] offline tau (B={args.block_size}) on {num_val} held-out answers: "
        f"{result['offline_tau']:.3f} (d_1 from {evaluation.D1_READ[args.d1_from]}; "
        f"{result[f'offline_tau_d1_from_{other}']:.3f} from {evaluation.D1_READ[other]}); "
        f"training {result['train_seconds']:.0f} s; peak memory {peak:.2f} GiB "
        f"({memory_kind})"
    )
    kept = "checkpoint.pt and optimizer-*.pt resume"
    if args.fsdp:
        kept = f"{distributed.SHARDED_CHECKPOINT}/ resumes"
    print(f"[done] target: {runtime.record_path(inputs.target)}")
    print(f"[done] answer caches: {inputs.cache_dir}")
    print(
        f"[done] drafter (+ train_args.json; {kept} or extend the run): {os.path.abspath(args.out)}"
    )


def cli_main(argv: list[str]) -> None:
    """`python train.py [prune | eval] ...`: the sub-command named first, else training."""
    if argv[:1] == ["prune"]:  # python train.py prune --drafter FOLDER ...
        pruning.prune_main(**vars(pruning.parse_prune_args(argv[1:])))
    elif argv[:1] == ["eval"]:  # python train.py eval --drafter FOLDER
        evaluation.eval_main(argv[1:])
    else:
        main(**vars(parse_args(argv)))


def run_command(argv: list[str]) -> None:
    """cli_main as a command: a bad input is one line (cli.run); so is Ctrl-C, with exit
    status 130. Inside the steps training saves first (checkpoints.Interrupted, its line
    already printed); anywhere else the answers and checkpoints already written are kept."""
    try:
        cli.run(cli_main, argv)
    except checkpoints.Interrupted:
        sys.exit(130)
    except KeyboardInterrupt:
        line = f"train.py {' '.join(argv[:1])}: interrupted"
        if argv[:1] not in (["prune"], ["eval"]):
            line = (
                "[train] interrupted, not at a step boundary: the answers and the last "
                "checkpoint written are kept, and the same command goes on from them"
            )
        print(line, file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run_command(sys.argv[1:])
