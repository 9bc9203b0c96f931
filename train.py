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
import random
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import d3d
import runtime
import toy
from systems import answers, cli, distributed, evaluation, memory, pruning

# steps in a row with a non-finite gradient before training stops: the run has diverged
MAX_SKIPPED_IN_A_ROW = 5

# the toy's runs: the default drafter, and answers to any prompts the toy does not ship
TOY_RUNS = "runs/toy"


# ---------------------------------------------------------------------------------------------
# Drafter: a pretrained causal LM with the target's tokenizer, some of its layers kept


def select_layers(num_layers: int, spec) -> list[int] | None:
    """`spec`: None (all), a count N (evenly spaced over the depth, first and last
    kept) or explicit ids "0,14,29"."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str) and "," in spec or isinstance(spec, (list, tuple)):
        if isinstance(spec, str):
            spec = spec.split(",")
        ids = [int(i) for i in spec]
        if any(not 0 <= i < num_layers for i in ids):
            raise runtime.UserError(
                f"layer ids {ids} out of range: the drafter-init has {num_layers} layers"
            )
        return ids
    n = int(spec)
    if not 1 <= n <= num_layers:
        raise runtime.UserError(f"--drafter-layers {n}: the drafter-init has {num_layers} layers")
    if n == 1:
        return [num_layers - 1]
    return [round(k * (num_layers - 1) / (n - 1)) for k in range(n)]


def build_drafter(
    drafter_init: str,
    tokenizer,
    *,
    target_vocab_size: int,
    layers=None,
    random_init: bool = False,
    meta: bool = False,
    **config,
) -> d3d.Drafter:
    """d3d.make_drafter on `drafter_init` after checking that it speaks the target's
    tokenizer; with `random_init`, its architecture with freshly initialised weights
    (from torch's current seed). With `meta`, the same drafter (names, shapes, layer
    cut, MASK row) on the meta device: no weights read, no memory (a rank > 0 under
    --fsdp, which receives its shards from rank 0: distributed.shard_model)."""
    try:
        init_tokenizer = AutoTokenizer.from_pretrained(drafter_init)
    except (OSError, ValueError):
        # no tokenizer saved with it: make_drafter still checks the vocabulary size
        init_tokenizer = None
    fingerprint = runtime.tokenizer_fingerprint
    if init_tokenizer is not None and fingerprint(init_tokenizer) != fingerprint(tokenizer):
        raise runtime.UserError(
            f"--drafter-init {drafter_init} uses a different tokenizer than the target: "
            "its token ids mean other text. Initialise the drafter from a checkpoint of "
            "the target's family"
        )
    if meta:
        with torch.device("meta"):
            model = random_weights(drafter_init)
    elif random_init:
        model = random_weights(drafter_init)
    else:
        # fp32 master weights
        model = AutoModelForCausalLM.from_pretrained(drafter_init, dtype=torch.float32)
    num_layers = model.config.get_text_config().num_hidden_layers
    layer_ids = select_layers(num_layers, layers)
    drafter = d3d.make_drafter(
        model,
        tokenizer=tokenizer,
        layers=layer_ids,
        target_vocab_size=target_vocab_size,
        **config,
    )
    # training on from a drafter: keep its layer ids
    if os.path.isfile(os.path.join(drafter_init, d3d.CONFIG_NAME)):
        kept = d3d.D3DConfig.load(drafter_init).layer_ids
        if kept is not None:
            if layer_ids is None:
                layer_ids = range(len(kept))
            drafter.d3d_config.layer_ids = [kept[i] for i in layer_ids]
    return drafter


def random_weights(drafter_init: str):
    """The architecture of `drafter_init` with freshly initialised fp32 weights."""
    config = AutoConfig.from_pretrained(drafter_init)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def freeze_embeddings(
    drafter: d3d.Drafter, hook: bool = True, device=None
) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """Freeze the input embeddings and the output layer, except the MASK row (a new
    token must learn its vector). Returns the embedding weight and its row mask
    (1 = trains); with `hook`, a gradient hook applies the mask.

    Under FSDP no autograd hook can: fully_shard replaces the parameter (a hook
    registered before is dropped) and writes the reduced gradient of the sharded one
    straight into .grad (a hook on it never fires), so sharded training calls this
    with hook=False before fully_shard, then distributed.freeze_sharded_rows on the
    sharded parameter. The mask goes to `device` (default the weight's; a drafter on
    the meta device has its weights elsewhere)."""
    weight = drafter.model.get_input_embeddings().weight
    if device is None:
        device = weight.device
    keep = torch.zeros(weight.shape[0], 1, device=device)
    keep[drafter.d3d_config.mask_token_id] = 1.0
    if hook:
        weight.register_hook(functools.partial(mask_rows, keep=keep))
    head = drafter.model.get_output_embeddings().weight
    # untied output layer: frozen whole (its MASK row is never used)
    if head is not weight:
        head.requires_grad_(False)
    return weight, keep


def mask_rows(grad: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The gradient of the embedding with every row but the kept ones zeroed."""
    return grad * keep.to(grad.dtype)


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainSettings:
    """What train_drafter needs besides the drafter and its data (main fills it from the flags)."""

    out: str  # the drafter folder: checkpoints go here, and a rerun resumes from them
    steps: int  # optimizer steps
    batch_size: int  # sequences per micro-batch and rank
    grad_accum: int  # micro-batches per optimizer step
    lr: float  # peak learning rate
    warmup: int  # linear warmup steps (get_lr)
    weight_decay: float  # AdamW's, on every trained weight but the frozen embedding
    grad_clip: float  # max gradient norm
    freeze: bool  # freeze the embeddings and the head, except the MASK row
    pad_id: int
    max_len: int  # sequences cut to this many tokens
    eval_every: int  # offline tau every N steps
    val_anchors: int  # blocks per held-out answer for tau
    save_every: int  # checkpoint every N steps
    seed: int  # data order and anchors
    bf16: bool  # bfloat16 compute, fp32 master weights
    resume: bool = True  # resume from a checkpoint in `out`
    rank: int = 0
    world: int = 1
    # FSDP2 (a process group must be up): the drafter is sharded in place
    fsdp: bool = False
    # where to train (None: the drafter's device; a rank > 0 under fsdp holds the
    # drafter on the meta device until distributed.shard_model fills its shards)
    device: torch.device | None = None
    # the checkpoint the drafter started from, kept in the recipe (checkpoint_recipe)
    init: str = ""


def train_drafter(drafter: d3d.Drafter, train, val, s: TrainSettings) -> dict:
    """AdamW on d3d_loss (L_block + lambda L_AR), the rate from get_lr.

    Checkpoints every s.save_every steps and resumes from them. With s.fsdp the
    drafter is sharded in place and returned as "sharded" (its FSDP root) with
    the result; every process then evaluates and saves."""
    device = s.device
    if device is None:
        device = drafter.device
    # FSDP casts to bf16 itself (distributed.shard_model)
    autocast = evaluation.bf16_autocast(device, s.bf16 and not s.fsdp)
    model, frozen = wrap_for_training(drafter, s, device)
    optimizer = make_optimizer(drafter, frozen, s)
    scheduler = make_scheduler(optimizer, s)
    recipe = checkpoint_recipe(drafter, s)
    start_step, skipped = resume_from_checkpoint(drafter, model, optimizer, scheduler, recipe, s)
    batches = MicroBatches(train, s, device)
    skipped_in_a_row = 0
    history = []
    loss_ema = None  # the running mean of the loss, for the progress bar
    tau = float("nan")
    start = time.perf_counter()
    drafter.train()
    bar = progress_bar(start_step, s)
    for step in bar:
        step_start = time.perf_counter()
        num_tokens = 0
        for a in range(s.grad_accum):
            input_ids, loss_mask = batches(step * s.grad_accum + a)
            num_tokens += int((input_ids != s.pad_id).sum())
            last = a == s.grad_accum - 1
            with gradient_sync(model, s, last):
                with autocast():
                    # d3d.d3d_loss: K, B, lambda and gamma from the drafter's config
                    loss, metrics = model(input_ids, loss_mask, generator=batches.anchors_rng)
                (loss / s.grad_accum).backward()
        # a NaN or Inf gradient never reaches AdamW: the step is skipped
        stepped = runtime.finite_step(optimizer, drafter.parameters(), s.grad_clip)
        # on a skipped step too: the rate stays a function of the step, as a resume assumes
        scheduler.step()
        if stepped:
            skipped_in_a_row = 0
            # only here: a NaN loss would stay in the running mean for good
            loss_ema = running_mean(loss_ema, loss.item())
        else:
            skipped_in_a_row += 1
            skipped += 1
        check_diverged(step, skipped_in_a_row, skipped)
        tokens_per_s = num_tokens * s.world / (time.perf_counter() - step_start)
        show_progress(bar, metrics, loss_ema, tokens_per_s, skipped, device)
        done = step + 1
        if evaluates(s, val) and done % s.eval_every == 0 and done < s.steps:
            tau = evaluate(drafter, val, model, s, autocast)
            history.append(report(done, tau, loss_ema, skipped, s, drafter.d3d_config.block_size))
        if done % s.save_every == 0 or done == s.steps:
            save(drafter, model, optimizer, scheduler, done, skipped, recipe, s)
    bar.close()
    # also when a rerun finds the run finished: evaluates with the new --num-val, ...
    if evaluates(s, val):
        tau = evaluate(drafter, val, model, s, autocast)
        history.append(report(s.steps, tau, loss_ema, skipped, s, drafter.d3d_config.block_size))
    result = {
        "offline_tau": tau,
        "history": history,
        "skipped_steps": skipped,
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    if s.fsdp:
        result["sharded"] = model
    return result


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

    def share_of_peak(step: int) -> float:
        return get_lr(step, s.warmup, s.steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, share_of_peak)


def wrap_for_training(drafter: d3d.Drafter, s: TrainSettings, device):
    """The drafter's loss as a module, sharded (FSDP2) or wrapped in DDP on
    several processes; embeddings frozen if s.freeze. Returns (model, the
    frozen embedding weight or None)."""
    frozen = None
    if s.freeze:
        frozen, keep = freeze_embeddings(drafter, hook=not s.fsdp, device=device)
    model = TrainingLoss(drafter)
    if s.fsdp:
        layers = drafter.model.get_decoder().layers
        distributed.shard_model(model, layers, s.bf16, device)
        if s.freeze:
            # fully_shard replaced the parameter, dropping the hooks of the old one
            frozen = drafter.model.get_input_embeddings().weight
            distributed.freeze_sharded_rows(frozen, keep)
    elif s.world > 1:
        # PyTorch's own DDP: gradients all-reduced in backward
        device_ids = None
        if device.type == "cuda":
            device_ids = [device]
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


def resume_from_checkpoint(drafter, model, optimizer, scheduler, recipe: dict, s: TrainSettings):
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


class MicroBatches:
    """This rank's micro-batches: batches(m) is the m-th, a function of m only
    (data order and anchors seeded by m), so a resume continues exactly."""

    def __init__(self, train, s: TrainSettings, device):
        self.shard = train[s.rank :: s.world]  # each rank its own sequences
        self.per_epoch = math.ceil(len(self.shard) / s.batch_size)
        self.s = s
        self.device = device
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
        return input_ids.to(self.device), loss_mask.to(self.device)


def gradient_sync(model, s: TrainSettings, last: bool):
    """DDP all-reduces once per step: no_sync on every micro-batch but the
    last. FSDP reduce-scatters every micro-batch: skipping it would keep whole
    unsharded gradients between micro-batches, the memory sharding saves."""
    if s.world > 1 and not s.fsdp and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def running_mean(loss_ema: float | None, loss: float) -> float:
    """The exponential running mean of the loss (0.9 old, 0.1 new)."""
    if loss_ema is None:
        return loss
    return 0.9 * loss_ema + 0.1 * loss


def check_diverged(step: int, skipped_in_a_row: int, skipped: int) -> None:
    """Stop after MAX_SKIPPED_IN_A_ROW steps in a row with a non-finite gradient."""
    if skipped_in_a_row < MAX_SKIPPED_IN_A_ROW:
        return
    raise RuntimeError(
        f"step {step + 1}: {skipped_in_a_row} steps in a row had a non-finite "
        f"gradient ({skipped} skipped in all); training has diverged. Lower "
        "--lr, use --dtype float32, or check the data for empty or corrupt answers"
    )


def progress_bar(start_step: int, s: TrainSettings):
    """tqdm over the steps left; rank 0's only."""
    return tqdm(
        range(start_step, s.steps),
        initial=start_step,
        total=s.steps,
        desc="train drafter",
        disable=s.rank > 0,
    )


def show_progress(bar, metrics: dict, loss_ema, tokens_per_s, skipped: int, device) -> None:
    """The step's numbers on the progress bar: running loss, the two terms,
    block accuracy (mean, and d1_acc: d_1's, read where decoding reads it),
    tokens per second, peak memory."""
    bar.set_postfix(
        loss=f"{loss_ema or float('nan'):.3f}",
        block=f"{metrics['loss_block']:.2f}",
        ar=f"{metrics['loss_ar']:.2f}",
        block_acc=f"{metrics['block_acc'].mean():.3f}",
        d1_acc=f"{metrics['block_acc'][0]:.2f}",
        tok_per_s=f"{tokens_per_s:.0f}",
        # CUDA: this step's peak; CPU: the run's
        peak_gib=f"{memory.peak_memory_gib(device, reset=True):.2f}",
        skipped=skipped,
    )


def evaluates(s: TrainSettings, val) -> bool:
    """Whether this process evaluates: rank 0, or every rank under FSDP
    (each pass goes through the sharded root); never without held-out data."""
    return (s.rank == 0 or s.fsdp) and bool(val)


def evaluate(drafter, val, model, s: TrainSettings, autocast) -> float:
    """Offline tau on the held-out answers (evaluation.evaluate_tau)."""
    sharded = None
    if s.fsdp:
        sharded = model
    return evaluation.evaluate_tau(
        drafter,
        val,
        val_anchors=s.val_anchors,
        pad_id=s.pad_id,
        max_len=s.max_len,
        autocast=autocast,
        sharded=sharded,
    )


def report(done: int, tau: float, loss_ema, skipped: int, s: TrainSettings, block_size) -> dict:
    """Print an evaluation (rank 0) and return it as a row of the history."""
    if s.rank == 0:
        line = f"[train] step {done}: loss {loss_ema or float('nan'):.3f}, "
        line += f"offline tau (B={block_size}) {tau:.3f}"
        if skipped:
            line += f", {skipped} steps skipped (non-finite gradient)"
        tqdm.write(line)
    loss = None
    if loss_ema is not None:
        loss = round(loss_ema, 4)
    return {"step": done, "loss": loss, "offline_tau": round(tau, 3), "skipped": skipped}


def save(drafter, model, optimizer, scheduler, done, skipped, recipe, s: TrainSettings) -> None:
    """A checkpoint after `done` steps: under FSDP every process writes its
    shards (distributed.save_sharded_checkpoint), else rank 0 alone."""
    if s.fsdp:
        state = {"scheduler": scheduler.state_dict(), "skipped": skipped, "recipe": recipe}
        distributed.save_sharded_checkpoint(s.out, done, model, optimizer, state)
    elif s.rank == 0:
        state = {
            "model": drafter.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "skipped": skipped,
            "recipe": recipe,
        }
        distributed.save_checkpoint(s.out, done, state, optimizer.state_dict())


class TrainingLoss(torch.nn.Module):
    """d3d.d3d_loss as a module's forward. DDP prepares its gradient
    all-reduce in the forward of the module it wraps, and FSDP gathers its
    root's weights there; d3d_loss calls the drafter's hidden_states and
    projects the labelled rows itself, so DDP and FSDP wrap this. `fn` runs
    another function of the drafter the same way (FSDP: evaluation)."""

    def __init__(self, drafter: d3d.Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, loss_mask, fn=None, **settings):
        if fn is None:
            fn = d3d.d3d_loss
        return fn(self.drafter, input_ids, loss_mask, **settings)


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


def checkpoint_recipe(drafter: d3d.Drafter, s: TrainSettings) -> dict:
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


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `python train.py`, grouped as --help shows them."""
    ap = cli.Parser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    g = ap.add_argument_group("data")
    g.add_argument("--target", help="target model: HF folder or hub name (default: the toy, --toy)")
    g.add_argument(
        "--toy",
        default=toy.SHIPPED,
        help="toy folder, when no --target: its target, prompts and answers, "
        "checked against its toy.json (default: the repository's, "
        "toy-target/; `python toy.py` builds others)",
    )
    g.add_argument(
        "--prompts", help="JSON Lines file of training prompts (default: the toy's train prompts)"
    )
    g.add_argument(
        "--prompt-field", default="question", help="field holding the prompt (default: question)"
    )
    g.add_argument(
        "--val-prompts",
        help="JSON Lines file of held-out prompts (default: toy test prompts, "
        "else --val-fraction of --prompts)",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of --prompts held out when there is no --val-prompts (default: 0.05)",
    )
    g.add_argument(
        "--num-prompts", type=int, help="use the first N training prompts (default: all)"
    )
    g.add_argument(
        "--num-val", type=int, default=200, help="use the first N held-out prompts (default: 200)"
    )
    g.add_argument(
        "--thinking", action="store_true", help="Qwen3: answer with thinking on (default: off)"
    )
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="cap on a target answer, tokens (default: 256)",
    )
    g.add_argument(
        "--gen-batch-size", type=int, default=64, help="prompts answered together (default: 64)"
    )
    g.add_argument(
        "--data-dir",
        help="where the answer caches go (default: the folder above --out; runs/toy for "
        "prompts the toy does not ship answers to)",
    )
    g = ap.add_argument_group("drafter")
    g.add_argument(
        "--drafter-init",
        help="causal LM with the target's tokenizer to start from (default: the target)",
    )
    g.add_argument(
        "--drafter-layers",
        help="keep N layers evenly spaced (first and last kept) or ids '0,5,29' "
        "(default: all; the first 2, '0,1', for the toy)",
    )
    g.add_argument(
        "--block-size", type=int, help="B, MASK tokens per block (default: 16; 8 for the toy)"
    )
    g.add_argument(
        "--num-anchors",
        type=int,
        help="K, blocks per training sequence (default: 64; 32 for the toy)",
    )
    g.add_argument(
        "--ar-weight", type=float, default=1.0, help="lambda, weight of the AR loss (default: 1.0)"
    )
    g.add_argument(
        "--decay-gamma",
        type=float,
        help="gamma, block position weights exp(-(i-1)/gamma) (default: off, uniform)",
    )
    g.add_argument(
        "--d1-from",
        choices=["causal", "mask"],
        default="causal",
        help="where the draft's first token d_1 is read: 'causal', the LM head at x_n's "
        "causal row, which lambda trains; 'mask', MASK 1 (default: causal)",
    )
    g.add_argument(
        "--random-init",
        action="store_true",
        help="same architecture as --drafter-init, random weights "
        "(the paper's Fig. 2; default: its pretrained weights)",
    )
    g = ap.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    g.add_argument(
        "--batch-size", type=int, default=8, help="sequences per micro-batch and rank (default: 8)"
    )
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default: 1)")
    g.add_argument(
        "--lr", type=float, help="peak learning rate (default: 1e-3; 6e-3 for the tiny toy drafter)"
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="linear warmup steps, then cosine to 10 %% (default: 20)",
    )
    g.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)"
    )
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (default: 1.0)")
    g.add_argument(
        "--freeze-embeddings",
        action="store_true",
        help="freeze embeddings and lm_head except the MASK row (default: train them)",
    )
    g.add_argument(
        "--max-len",
        type=int,
        default=1024,
        help="cut sequences to this many tokens (default: 1024)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="bfloat16 autocast (fp32 master weights) or float32 (default: auto = "
        "bfloat16 where the device does it natively: CUDA, or a CPU with "
        "AVX512-BF16/AMX; else float32)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in backward: less memory (SmolLM2, "
        "K 64, batch 2, 1,024 tokens: 3.2 -> 2.2 GiB), ~30 %% more compute",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard fp32 weights, gradients and AdamW moments over the processes "
        "(FSDP2, per decoder layer and root; bf16 by FSDP's mixed precision: layers "
        "gathered in bf16, gradients reduced in fp32). Use it when 16 bytes a "
        "parameter do not fit one GPU (the Qwen3-8B drafter: RESULTS.md, FSDP "
        "memory); else plain torchrun (DDP) is simpler and faster. Rank 0 alone "
        "reads the drafter's weights (one host copy, not one a process) and "
        "broadcasts them into the shards. Checkpoints: OUT/checkpoint-fsdp, one "
        "file a process, resumed by any number of processes (with another number "
        "the data order follows the new sharding). Without torchrun: FSDP on one "
        "process (default: off)",
    )
    # rank 0 works alone while the others wait in a collective: it reads the whole
    # checkpoint before the first broadcast, and at the end writes the gathered
    # drafter. At 8B that is 16 GB read into 33 GB of fp32 and 16 GB of bf16 written:
    # minutes on a local disk, ~30 min at 10 MB/s on a slow network disk. NCCL's own
    # default (10 min) would kill a healthy run there; 60 min still ends a hung one
    # within the hour
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="how long a process waits for the others in a collective before the run "
        "fails (torchrun and --fsdp; default: 60, for rank 0 reading and writing an 8B "
        "drafter alone while the others wait)",
    )
    g = ap.add_argument_group("evaluation and output")
    g.add_argument(
        "--out", default="runs/toy/drafter", help="drafter folder (default: runs/toy/drafter)"
    )
    g.add_argument(
        "--eval-every", type=int, default=100, help="offline tau every N steps (default: 100)"
    )
    g.add_argument(
        "--val-anchors",
        type=int,
        default=32,
        help="blocks per held-out answer for tau (default: 32)",
    )
    g.add_argument(
        "--save-every", type=int, default=100, help="checkpoint every N steps (default: 100)"
    )
    g.add_argument(
        "--no-resume", dest="resume", action="store_false", help="ignore out/checkpoint.pt"
    )
    g.add_argument(
        "--plot",
        metavar="PATH.png",
        help="at the end, draw the share of held-out blocks with d_1 .. d_i all "
        "accepted, by position i, d_1 from the head and from MASK 1 (as train.py "
        "eval --plot); needs matplotlib (requirements-plots.txt)",
    )
    g.add_argument("--seed", type=int, default=0, help="data order and anchors (default: 0)")
    g.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's choice; 1 for the toy, whose tiny "
        "models run fastest on one; use 1 on a CPU shared with other jobs)",
    )
    g.add_argument(
        "--device",
        help="cpu, cuda, ... (default: cuda if available; cuda:LOCAL_RANK under torchrun)",
    )
    return ap.parse_args(argv)


# Every number a flag takes, and the values it accepts (None: not given, the default applies).
# Zero is legal where it means something: --seed 0, --warmup 0 (no warmup), --ar-weight 0
# (Table 3's lambda = 0), --weight-decay 0.
RANGES = {
    "num_prompts": cli.Range(int, low=1),
    "num_val": cli.Range(int, low=1),
    "val_fraction": cli.Range(float, low=0, high=1, low_open=True, high_open=True),
    "max_new_tokens": cli.Range(int, low=1),
    "gen_batch_size": cli.Range(int, low=1),
    "block_size": cli.Range(int, low=1),
    "num_anchors": cli.Range(int, low=1),
    "ar_weight": cli.Range(float, low=0),
    "decay_gamma": cli.Range(float, low=0, low_open=True),
    "steps": cli.Range(int, low=1),
    "batch_size": cli.Range(int, low=1),
    "grad_accum": cli.Range(int, low=1),
    "lr": cli.Range(float, low=0, low_open=True),
    "warmup": cli.Range(int, low=0),
    "weight_decay": cli.Range(float, low=0),
    "grad_clip": cli.Range(float, low=0, low_open=True),
    "max_len": cli.Range(int, low=2),
    "dist_timeout": cli.Range(float, low=0, low_open=True),
    "eval_every": cli.Range(int, low=1),
    "val_anchors": cli.Range(int, low=1),
    "save_every": cli.Range(int, low=1),
    "seed": cli.Range(int, low=0),
    "threads": cli.Range(int, low=1),
}

# The toy's own settings where a flag is not given (short answers, a 0.4M-parameter drafter)
TOY_DEFAULTS = {"block_size": 8, "num_anchors": 32, "lr": 6e-3, "threads": 1}
# Everywhere else
DEFAULTS = {"block_size": 16, "num_anchors": 64, "lr": 1e-3}


def check_args(args: argparse.Namespace) -> None:
    """Every flag in its range and every file it names readable, before anything loads: a
    bad value raises runtime.UserError (one line), never a traceback halfway through a run."""
    cli.check_ranges(vars(args), RANGES)
    if args.drafter_layers is not None and str(args.drafter_layers).strip() == "":
        raise runtime.UserError("--drafter-layers is empty — give a count N or ids '0,5,29'")
    if args.plot is not None:
        evaluation.check_plotting()
    if args.target is None:
        return
    cli.check_model_folder("--target", args.target)
    if args.prompts is None:
        raise runtime.UserError("--target needs --prompts — give a JSON Lines file of prompts")
    cli.read_jsonl("--prompts", args.prompts)
    if args.val_prompts is not None:
        cli.read_jsonl("--val-prompts", args.val_prompts)
    if args.drafter_init is not None:
        cli.check_model_folder("--drafter-init", args.drafter_init)


def fill_defaults(args: argparse.Namespace, toy_run: bool) -> None:
    """The documented defaults of flags the user did not give; a value given is kept."""
    defaults = DEFAULTS
    if toy_run:
        defaults = TOY_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def use_the_toy(args: argparse.Namespace, paths: dict, rank: int) -> dict:
    """Point the flags not given at the built-in toy (toy.py: scaffolding, not the
    method): its target, prompts and shipped answers. One toy for every run, wherever
    --out puts the drafter: the same target and the same answers, checked against
    toy.json. Returns what to read (as found_inputs)."""
    if rank == 0:
        print(
            f"[toy] target and its answers from {paths['target']}; the drafter goes to {args.out}"
        )
    found = found_inputs(args)
    if args.prompts is None:
        found["train_answers"] = paths["train_answers"]
        args.prompts = paths["train"]
    else:
        cli.read_jsonl("--prompts", args.prompts)
    if args.val_prompts is None:
        found["val_answers"] = paths["test_answers"]
        found["val_prompts"] = paths["test"]
    else:
        cli.read_jsonl("--val-prompts", args.val_prompts)
    args.target = paths["target"]
    if args.data_dir is None:
        args.data_dir = TOY_RUNS
    if found["layers"] is None:
        # the target's first 2 layers, the plain prefix (LAB.md, exercise 5, compares others)
        found["layers"] = "0,1"
    return found


def found_inputs(args: argparse.Namespace) -> dict:
    """What a run reads besides --target and --prompts: the held-out prompts, the
    answer files shipped with them (None: the target writes them) and the layers kept."""
    return {
        "val_prompts": args.val_prompts,
        "train_answers": None,
        "val_answers": None,
        "layers": args.drafter_layers,
    }


def load_answers(args, found: dict, data: dict) -> tuple[list, list]:
    """The target's answers to the training and the held-out prompts (answers.load_data:
    cached, or written now); without --val-prompts the last --val-fraction of --prompts."""
    train = answers.load_data(
        args.target,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        answers=found["train_answers"],
        **data,
    )
    if found["val_prompts"]:
        val = answers.load_data(
            args.target,
            prompts=found["val_prompts"],
            num_prompts=args.num_val,
            answers=found["val_answers"],
            **data,
        )
        return train, val
    num_val = min(args.num_val, round(len(train) * args.val_fraction))
    return train[: len(train) - num_val], train[len(train) - num_val :]


def default_device(name: str | None) -> torch.device:
    """The device a flag names; by default CUDA if there is one, else the CPU."""
    if name is None:
        name = "cpu"
        if torch.cuda.is_available():
            name = "cuda"
    return torch.device(name)


def main(**overrides) -> dict:
    """Run the whole recipe. Keyword arguments are the command-line flags (snake_case);
    defaults as there."""
    defaults = vars(parse_args([]))
    unknown = overrides.keys() - defaults.keys()
    if unknown:
        raise TypeError(f"unknown arguments: {sorted(unknown)}")
    args = argparse.Namespace(**{**defaults, **overrides})
    check_args(args)
    toy_run = args.target is None
    if toy_run:
        paths = toy.open_toy(args.toy)
    fill_defaults(args, toy_run)
    device = default_device(args.device)
    device, rank, world = distributed.start_process_group(device, args.fsdp, args.dist_timeout)
    if toy_run and args.dtype == "auto":
        # the toy's tiny models: bf16 would buy nothing and round more
        args.dtype = "float32"
    bf16 = runtime.resolve_dtype(args.dtype, device) == torch.bfloat16
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    found = found_inputs(args)
    if toy_run:
        found = use_the_toy(args, paths, rank)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.dirname(os.path.abspath(args.out))
    data = dict(
        tokenizer=tokenizer,
        prompt_field=args.prompt_field,
        thinking=args.thinking,
        cache_dir=data_dir,
        max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size,
        device=device,
        dtype=None,
        rank=rank,
        world=world,
    )
    if bf16:
        data["dtype"] = torch.bfloat16
    train, val = load_answers(args, found, data)

    target_config = AutoConfig.from_pretrained(args.target).get_text_config()
    # FSDP: rank 0 alone reads the weights, the others get shards (distributed.shard_model)
    on_meta = args.fsdp and rank > 0
    init = args.drafter_init or args.target
    drafter = build_drafter(
        init,
        tokenizer,
        target_vocab_size=target_config.vocab_size,
        layers=found["layers"],
        block_size=args.block_size,
        num_anchors=args.num_anchors,
        ar_weight=args.ar_weight,
        decay_gamma=args.decay_gamma,
        d1_from=args.d1_from,
        random_init=args.random_init,
        meta=on_meta,
    )
    if not on_meta:
        drafter.to(device)
    if args.gradient_checkpointing:
        drafter.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    if rank == 0:
        describe_drafter(args, drafter, init, len(train), len(val))
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    settings = TrainSettings(
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        freeze=args.freeze_embeddings,
        pad_id=pad_id,
        max_len=args.max_len,
        eval_every=args.eval_every,
        val_anchors=args.val_anchors,
        save_every=args.save_every,
        seed=args.seed,
        bf16=bf16,
        resume=args.resume,
        rank=rank,
        world=world,
        fsdp=args.fsdp,
        device=device,
        init=runtime.record_path(init),
    )
    result = train_drafter(drafter, train, val, settings)

    peak = memory.peak_memory_gib(device)
    # the same held-out blocks with d_1 drafted by MASK 1 instead of the causal row, or
    # the reverse
    other = "mask"
    if drafter.d3d_config.d1_from == "mask":
        other = "causal"
    other_tau = f"offline_tau_d1_from_{other}"
    held_out = dict(
        val_anchors=args.val_anchors,
        pad_id=pad_id,
        max_len=args.max_len,
    )
    sharded = result.pop("sharded", None)
    if sharded is not None:
        # every rank evaluates the sharded drafter, then all gather it once, onto
        # rank 0's host
        result[other_tau] = evaluation.evaluate_tau(
            drafter, val, sharded=sharded, d1_from=other, **held_out
        )
        # ranks > 0 keep their shards
        drafter = distributed.gather_drafter(sharded, drafter) or drafter
    if bf16 and (rank == 0 or sharded is None):
        # the final drafter in the dtype it was trained in (the fp32 master weights stay
        # in the checkpoint)
        drafter.model.to(torch.bfloat16)
    if rank == 0:
        autocast = evaluation.bf16_autocast(device, bf16)
        if sharded is None:
            result[other_tau] = evaluation.evaluate_tau(
                drafter, val, autocast=autocast, d1_from=other, **held_out
            )
        if args.plot is not None:
            title = f"{args.out}: held-out blocks with d_1 .. d_i all accepted"
            result["curve"] = evaluation.plot_curves(
                args.plot, drafter, val, title=title, autocast=autocast, **held_out
            )
        drafter.save_pretrained(args.out, tokenizer=tokenizer)
        record = training_record(args, found, drafter, result)
        record["peak_memory_gib"] = round(peak, 2)
        record["device"] = str(device)
        record["world_size"] = world
        record["compute_dtype"] = "float32"
        if bf16:
            record["compute_dtype"] = "bfloat16"
        record["fsdp"] = args.fsdp
        with open(os.path.join(args.out, "train_args.json"), "w") as f:
            json.dump(record, f, indent=2)
        print_done(args, result, other, len(val), peak, device, data_dir)
    distributed.end_process_group()
    return {**result, "drafter": drafter, "out": args.out}


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


def training_record(args, found: dict, drafter: d3d.Drafter, result: dict) -> dict:
    """train_args.json: the flags, the files read (the toy's relative to the repository,
    a user's as given: runtime.record_path) and the result."""
    return {
        **vars(args),
        "target": runtime.record_path(args.target),
        "toy": runtime.record_path(args.toy),
        "prompts": runtime.record_path(args.prompts),
        "val_prompts": runtime.record_path(found["val_prompts"]),
        "answers": runtime.record_path(found["train_answers"]),
        "val_answers": runtime.record_path(found["val_answers"]),
        "layer_ids": drafter.d3d_config.layer_ids,
        **result,
    }


def print_done(args, result: dict, other: str, num_val: int, peak, device, data_dir):
    """The closing lines: tau both ways, time, memory, and where everything went."""
    names = {"causal": "the causal row", "mask": "MASK 1"}
    first = "causal"
    if other == "causal":
        first = "mask"
    memory_kind = "RSS"
    if device.type == "cuda":
        memory_kind = "GPU allocated"
    print(
        f"[done] offline tau (B={args.block_size}) on {num_val} held-out answers: "
        f"{result['offline_tau']:.3f} (d_1 from {names[first]}; "
        f"{result[f'offline_tau_d1_from_{other}']:.3f} from {names[other]}); "
        f"training {result['train_seconds']:.0f} s; peak memory {peak:.2f} GiB "
        f"({memory_kind})"
    )
    kept = "checkpoint.pt and optimizer-*.pt resume"
    if args.fsdp:
        kept = f"{distributed.SHARDED_CHECKPOINT}/ resumes"
    print(f"[done] target: {runtime.record_path(args.target)}")
    print(f"[done] answer caches: {data_dir}")
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


if __name__ == "__main__":
    cli.run(cli_main, sys.argv[1:])
