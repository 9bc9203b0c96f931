"""Train a D3D drafter on answers written by the target itself (paper "Drafter training", Fig. 1a).

    python train.py                                   # built-in toy on CPU, no download: runs/toy/drafter
    python train.py --seed 1 --ar-weight 0 --d1-from mask --out runs/lab/lam0   # a toy ablation (LAB.md)
    python train.py --target PATH --prompts train.jsonl --val-prompts test.jsonl --drafter-layers 8 ...
    torchrun --nproc_per_node=N train.py ...          # DistributedDataParallel; data sharded by rank
    torchrun --nproc_per_node=N train.py ... --fsdp   # FSDP2: weights, gradients, AdamW sharded (a drafter > 1 GPU)
    python train.py prune --drafter runs/toy/drafter --min-layers 1     # progressive layer pruning (Fig. 1b)
    python train.py eval --drafter runs/toy/drafter                     # offline tau on the held-out answers

1. data: the target answers the prompts greedily (chat template, thinking off); prompt and response token ids are
   cached as JSON Lines (a header naming the target and its tokenizer, then one line per prompt), so a rerun or an
   interrupted run only answers what is missing. The toy ships its target's answers (toy-target/, see toy.py).
2. drafter: any causal LM with the target's tokenizer (--drafter-init, default the target), keeping some layers.
3. training: AdamW on L_block + lambda * L_AR (d3d.d3d_loss), offline tau on held-out prompts (d3d.offline_tau),
   checkpoints that a rerun resumes from; the final drafter folder holds train_args.json naming its target.
4. pruning (`prune`): d3d.prune_drafter on the same cached answers, then the pruned and unpruned drafters decode
   the same held-out prompts against the target in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import d3d
import runtime
import toy
from systems import answers, cli, distributed, evaluation, memory, pruning

MAX_SKIPPED_IN_A_ROW = (
    5  # steps in a row with a non-finite gradient before training stops: the run has diverged
)

TOY_RUNS = "runs/toy"  # the toy's runs: the default drafter, and answers to any prompts the toy does not ship


# ----------------------------------------------------------------------------------------------------------------------
# Drafter: a pretrained causal LM with the target's tokenizer, some of its layers kept


def select_layers(num_layers: int, spec) -> list[int] | None:
    """`spec`: None (all), a count N (evenly spaced over the depth, first and last kept) or explicit ids "0,14,29"."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str) and "," in spec or isinstance(spec, (list, tuple)):
        ids = [int(i) for i in (spec.split(",") if isinstance(spec, str) else spec)]
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
    """d3d.make_drafter on `drafter_init` after checking that it speaks the target's tokenizer; with `random_init`,
    its architecture with freshly initialised weights (from torch's current seed). With `meta`, the same drafter
    (names, shapes, layer cut, MASK row) on the meta device: no weights read, no memory (a rank > 0 under --fsdp,
    which receives its shards from rank 0: distributed.shard_model)."""
    try:
        init_tokenizer = AutoTokenizer.from_pretrained(drafter_init)
    except (
        OSError,
        ValueError,
    ):  # no tokenizer saved with it: make_drafter still checks the vocabulary size
        init_tokenizer = None
    fingerprint = runtime.tokenizer_fingerprint
    if init_tokenizer is not None and fingerprint(init_tokenizer) != fingerprint(tokenizer):
        raise runtime.UserError(
            f"--drafter-init {drafter_init} uses a different tokenizer than the target: its token ids "
            "mean other text. Initialise the drafter from a checkpoint of the target's family"
        )
    if random_init or meta:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(drafter_init), dtype=torch.float32
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            drafter_init, dtype=torch.float32
        )  # fp32 master weights
    layer_ids = select_layers(model.config.get_text_config().num_hidden_layers, layers)
    drafter = d3d.make_drafter(
        model, tokenizer=tokenizer, layers=layer_ids, target_vocab_size=target_vocab_size, **config
    )
    if os.path.isfile(
        os.path.join(drafter_init, d3d.CONFIG_NAME)
    ):  # training on from a drafter: keep its layer ids
        kept = d3d.D3DConfig.load(drafter_init).layer_ids
        if kept is not None:
            drafter.d3d_config.layer_ids = [kept[i] for i in (layer_ids or range(len(kept)))]
    return drafter


def freeze_embeddings(
    drafter: d3d.Drafter, hook: bool = True, device=None
) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """Freeze the input embeddings and the output layer, except the MASK row (a new token must learn its vector).
    Returns the embedding weight and its row mask (1 = trains); with `hook`, a gradient hook applies the mask. Under
    FSDP no autograd hook can: fully_shard replaces the parameter (a hook registered before is dropped) and writes
    the reduced gradient of the sharded one straight into .grad (a hook on it never fires), so sharded training
    calls it with hook=False before fully_shard, then distributed.freeze_sharded_rows on the sharded parameter. The
    mask goes to `device` (default the weight's; a drafter on the meta device has its weights elsewhere)."""
    weight = drafter.model.get_input_embeddings().weight
    keep = torch.zeros(weight.shape[0], 1, device=device or weight.device)
    keep[drafter.d3d_config.mask_token_id] = 1.0
    if hook:
        weight.register_hook(lambda grad: grad * keep.to(grad.dtype))
    head = drafter.model.get_output_embeddings().weight
    if head is not weight:  # untied output layer: frozen whole (its MASK row is never used)
        head.requires_grad_(False)
    return weight, keep


# ----------------------------------------------------------------------------------------------------------------------
# Training


class TrainingLoss(torch.nn.Module):
    """d3d.d3d_loss as a module's forward. DDP prepares its gradient all-reduce in the forward of the module it
    wraps, and FSDP gathers its root's weights there; d3d_loss calls the drafter's hidden_states and projects the
    labelled rows itself, so DDP and FSDP wrap this. `fn` runs another function of the drafter the same way (FSDP:
    evaluation)."""

    def __init__(self, drafter: d3d.Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, loss_mask, fn=None, **settings):
        return (fn or d3d.d3d_loss)(self.drafter, input_ids, loss_mask, **settings)


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


def checkpoint_recipe(
    drafter: d3d.Drafter,
    *,
    init: str,
    block_size: int,
    num_anchors: int,
    ar_weight: float,
    decay_gamma: float | None,
) -> dict:
    """The settings a checkpoint was trained with (RECIPE_FLAGS), as plain values."""
    config = drafter.d3d_config
    return {
        "init": init,
        "layer_ids": config.layer_ids,
        "block_size": block_size,
        "num_anchors": num_anchors,
        "ar_weight": ar_weight,
        "decay_gamma": decay_gamma,
        "d1_from": config.d1_from,
        "tokenizer": config.tokenizer_hash,
    }


def check_resume(saved: dict, recipe: dict, out: str) -> None:
    """Refuse to resume a checkpoint trained with other settings: say which one differs."""
    fresh = "start fresh with --no-resume, or give another --out"
    if "recipe" not in saved:
        raise runtime.UserError(f"--out {out} holds a checkpoint that records no recipe — {fresh}")
    for key, value in recipe.items():
        before = saved["recipe"].get(key)
        if before != value:
            raise runtime.UserError(
                f"--out {out} holds a checkpoint trained with {RECIPE_FLAGS[key]} = {before!r}, "
                f"this run asks for {value!r} — rerun with the same setting to resume, or {fresh}"
            )


def train_drafter(
    drafter: d3d.Drafter,
    train,
    val,
    *,
    out: str,
    steps: int,
    batch_size: int,
    grad_accum: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    grad_clip: float,
    freeze: bool,
    pad_id: int,
    max_len: int,
    num_anchors: int,
    block_size: int,
    ar_weight: float,
    decay_gamma: float | None,
    eval_every: int,
    val_anchors: int,
    save_every: int,
    seed: int,
    bf16: bool,
    resume: bool = True,
    rank: int = 0,
    world: int = 1,
    fsdp: bool = False,
    device: torch.device | None = None,
    init: str = "",
) -> dict:
    """AdamW (warmup then cosine to 10 %) on d3d_loss; `batch_size` sequences per micro-batch and rank, `grad_accum`
    micro-batches per step. Checkpoints every `save_every` steps (distributed.save_checkpoint; with `fsdp`,
    distributed.save_sharded_checkpoint); resumes from them if present. With `fsdp` (a process group must be up) the
    drafter is sharded in place and returned as "sharded" (its FSDP root) with the result; every process evaluates
    and saves.
    `device`: where to train, default the drafter's (a rank > 0 under `fsdp` holds it on the meta device until
    distributed.shard_model fills its shards from rank 0). `init`: the checkpoint the drafter started from, kept in
    the checkpoint's recipe (checkpoint_recipe) so that a resume with other settings is refused."""
    device = device or drafter.device
    # FSDP casts to bf16 itself (distributed.shard_model); DDP and one process autocast around fp32 weights
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if bf16 and not fsdp
        else contextlib.nullcontext
    )
    frozen, keep = (
        freeze_embeddings(drafter, hook=not fsdp, device=device) if freeze else (None, None)
    )
    model = TrainingLoss(drafter)
    if fsdp:
        distributed.shard_model(model, drafter.model.get_decoder().layers, bf16, device)
        if freeze:  # fully_shard replaced the parameter, dropping the hooks of the old one
            frozen = drafter.model.get_input_embeddings().weight
            distributed.freeze_sharded_rows(frozen, keep)
    elif world > 1:  # PyTorch's own DDP: gradients all-reduced in backward
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    decayed = [p for p in drafter.parameters() if p.requires_grad and p is not frozen]
    groups = [{"params": decayed, "weight_decay": weight_decay}] + (
        [{"params": [frozen], "weight_decay": 0.0}] if frozen is not None else []
    )
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    schedule = lambda s: (
        min(1.0, (s + 1) / max(warmup, 1))
        * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s / steps, 1))))
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    recipe = checkpoint_recipe(
        drafter,
        init=init,
        block_size=block_size,
        num_anchors=num_anchors,
        ar_weight=ar_weight,
        decay_gamma=decay_gamma,
    )

    def check(saved: dict) -> None:
        check_resume(saved, recipe, out)

    start_step, skipped, skipped_in_a_row = (
        0,
        0,
        0,
    )  # steps dropped for a non-finite gradient (runtime.finite_step)
    if fsdp:
        state = distributed.load_sharded_checkpoint(out, model, optimizer, check) if resume else {}
    else:
        if (
            resume
            and not os.path.exists(os.path.join(out, "checkpoint.pt"))
            and os.path.isdir(os.path.join(out, distributed.SHARDED_CHECKPOINT))
        ):
            raise runtime.UserError(
                f"{out} holds a checkpoint of an --fsdp run ({distributed.SHARDED_CHECKPOINT}): resume it "
                "with --fsdp (any number of processes), or start afresh with --no-resume"
            )
        state, optimizer_state = distributed.load_checkpoint(out) if resume else ({}, None)
        if state:
            check(state)
            drafter.load_state_dict(state["model"])
            if optimizer_state is not None:
                optimizer.load_state_dict(optimizer_state)
    if state:
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["python_rng"])
        start_step, skipped = state["step"], state.get("skipped", 0)
        if rank == 0:
            saved_by = f" (saved by {state['world']} processes, resumed by {world})" if fsdp else ""
            print(
                f"[train] resumed from {state.get('path') or os.path.join(out, 'checkpoint.pt')} at step "
                f"{start_step}{saved_by}"
            )

    shard = train[rank::world]  # each rank its own sequences
    per_epoch = math.ceil(len(shard) / batch_size)
    anchors_rng = torch.Generator()

    def micro_batch(
        m: int,
    ):  # the m-th micro-batch of this rank: a function of m only, so a resume continues exactly
        epoch, k = divmod(m, per_epoch)
        order = torch.randperm(
            len(shard), generator=torch.Generator().manual_seed(seed * 7919 + epoch)
        ).tolist()
        anchors_rng.manual_seed((seed * 1_000_003 + m) * world + rank)
        examples = [shard[i] for i in order[k * batch_size : (k + 1) * batch_size]]
        input_ids, loss_mask = answers.collate(examples, pad_id, max_len)
        return input_ids.to(device), loss_mask.to(device)

    history, tau, loss_ema, start = [], float("nan"), None, time.perf_counter()

    def evaluate(done: int) -> float:
        tau = evaluation.evaluate_tau(
            drafter,
            val,
            block_size=block_size,
            num_anchors=val_anchors,
            pad_id=pad_id,
            max_len=max_len,
            autocast=autocast,
            sharded=model if fsdp else None,
        )
        history.append(
            {
                "step": done,
                "loss": loss_ema and round(loss_ema, 4),
                "offline_tau": round(tau, 3),
                "skipped": skipped,
            }
        )
        if rank == 0:
            tqdm.write(
                f"[train] step {done}: loss {loss_ema or float('nan'):.3f}, offline tau (B={block_size}) "
                f"{tau:.3f}{f', {skipped} steps skipped (non-finite gradient)' if skipped else ''}"
            )
        return tau

    drafter.train()
    bar = tqdm(
        range(start_step, steps),
        initial=start_step,
        total=steps,
        desc="train drafter",
        disable=rank > 0,
    )
    for step in bar:
        num_tokens, step_start = 0, time.perf_counter()
        for a in range(grad_accum):
            input_ids, loss_mask = micro_batch(step * grad_accum + a)
            num_tokens += int((input_ids != pad_id).sum())
            last = a == grad_accum - 1
            # DDP: all-reduce once per step. FSDP reduce-scatters every micro-batch: skipping it would keep whole
            # unsharded gradients between micro-batches, the memory sharding saves
            with (
                model.no_sync() if world > 1 and not fsdp and not last else contextlib.nullcontext()
            ):
                with autocast():
                    loss, metrics = model(
                        input_ids,
                        loss_mask,
                        num_anchors=num_anchors,
                        block_size=block_size,
                        ar_weight=ar_weight,
                        decay_gamma=decay_gamma,
                        generator=anchors_rng,
                    )
                (loss / grad_accum).backward()
        # a NaN or Inf never reaches AdamW. FSDP: clip_grad_norm_ of DTensor gradients returns a replicated DTensor,
        # the norm over all shards, so every rank reads the same value and decides alike
        stepped = runtime.finite_step(optimizer, drafter.parameters(), grad_clip)
        scheduler.step()  # on a skipped step too: the rate stays a function of the step number, as a resume assumes
        skipped_in_a_row = 0 if stepped else skipped_in_a_row + 1
        skipped += not stepped
        if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise RuntimeError(
                f"step {step + 1}: {skipped_in_a_row} steps in a row had a non-finite gradient "
                f"({skipped} skipped in all); training has diverged. Lower --lr, use --dtype float32, "
                "or check the data for empty or corrupt answers"
            )
        if stepped:  # a NaN loss would stay in the running mean for good
            loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix(
            loss=f"{loss_ema or float('nan'):.3f}",
            block=f"{metrics['loss_block']:.2f}",
            ar=f"{metrics['loss_ar']:.2f}",
            block_acc=f"{metrics['block_acc'].mean():.3f}",
            acc1=f"{metrics['block_acc'][0]:.2f}",
            tok_per_s=f"{num_tokens * world / (time.perf_counter() - step_start):.0f}",
            # CUDA: this step's peak; CPU: the run's
            peak_gib=f"{memory.peak_memory_gib(device, reset=True):.2f}",
            skipped=skipped,
        )
        done = step + 1
        if (
            (rank == 0 or fsdp) and val and done % eval_every == 0 and done < steps
        ):  # FSDP: every rank's pass
            evaluate(done)
        if fsdp and (done % save_every == 0 or done == steps):
            distributed.save_sharded_checkpoint(
                out,
                done,
                model,
                optimizer,
                {"scheduler": scheduler.state_dict(), "skipped": skipped, "recipe": recipe},
            )
        elif rank == 0 and (done % save_every == 0 or done == steps):
            distributed.save_checkpoint(
                out,
                done,
                {
                    "model": drafter.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state(),
                    "python_rng": random.getstate(),
                    "skipped": skipped,
                    "recipe": recipe,
                },
                optimizer.state_dict(),
            )
    bar.close()
    if (
        rank == 0 or fsdp
    ) and val:  # also when a rerun finds the run finished: evaluates with the new --num-val, ...
        tau = evaluate(steps)
    return {
        "offline_tau": tau,
        "history": history,
        "skipped_steps": skipped,
        "train_seconds": round(time.perf_counter() - start, 1),
        **({"sharded": model} if fsdp else {}),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
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
        "--first-token",
        choices=["causal", "mask"],
        default="causal",
        help="where the "
        "draft's first token d_1 is read: 'causal', the causal next-token head that lambda trains; 'mask', "
        "MASK 1 (default: causal)",
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
        help="bfloat16 autocast (fp32 master weights) or float32 (default: auto = bfloat16 where the "
        "device does it natively: CUDA, or a CPU with AVX512-BF16/AMX; else float32)",
    )
    g.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer's activations in "
        "backward: less memory (SmolLM2, K 64, batch 2, 1,024 tokens: 3.2 -> 2.2 GiB), ~30 %% more compute",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard fp32 weights, gradients and AdamW moments over the "
        "processes (FSDP2, per decoder layer and root; bf16 by FSDP's mixed precision: layers gathered in "
        "bf16, gradients reduced in fp32). Use it when 16 bytes a parameter do not fit one GPU (the "
        "Qwen3-8B drafter: RESULTS.md, FSDP memory); else plain torchrun (DDP) is simpler and faster. "
        "Rank 0 alone reads the drafter's weights (one host copy, not one a process) and broadcasts "
        "them into the shards. "
        "Checkpoints: OUT/checkpoint-fsdp, one file a process, resumed by any number of processes (with "
        "another number the data order follows the new sharding). Without torchrun: FSDP on one process "
        "(default: off)",
    )
    # rank 0 works alone while the others wait in a collective: it reads the whole checkpoint before the first
    # broadcast, and at the end writes the gathered drafter. At 8B that is 16 GB read into 33 GB of fp32 and 16 GB
    # of bf16 written: minutes on a local disk, ~30 min at 10 MB/s on a slow network disk. NCCL's own default (10
    # min) would kill a healthy run there; 60 min still ends a hung one within the hour
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        metavar="MINUTES",
        help="how long a process waits "
        "for the others in a collective before the run fails (torchrun and --fsdp; default: 60, for "
        "rank 0 reading and writing an 8B drafter alone while the others wait)",
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
    """Every flag in its range and every file it names readable, before anything loads: a bad
    value raises runtime.UserError (one line), never a traceback halfway through a run."""
    cli.check_ranges(vars(args), RANGES)
    if args.drafter_layers is not None and str(args.drafter_layers).strip() == "":
        raise runtime.UserError("--drafter-layers is empty — give a count N or ids '0,5,29'")
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
    """The documented defaults of flags the user did not give; a value given is kept as it is."""
    defaults = TOY_DEFAULTS if toy_run else DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(**overrides) -> dict:
    """Run the whole recipe. Keyword arguments are the command-line flags (snake_case); defaults as there."""
    defaults = vars(parse_args([]))
    if overrides.keys() - defaults.keys():
        raise TypeError(f"unknown arguments: {sorted(overrides.keys() - defaults.keys())}")
    args = argparse.Namespace(**{**defaults, **overrides})
    check_args(args)
    toy_run = args.target is None
    if toy_run:
        paths = toy.open_toy(args.toy)
    fill_defaults(args, toy_run)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device, rank, world = distributed.start_process_group(device, args.fsdp, args.dist_timeout)
    if toy_run and args.dtype == "auto":
        args.dtype = "float32"  # the toy's tiny models: bf16 would buy nothing and round more
    bf16 = runtime.resolve_dtype(args.dtype, device) == torch.bfloat16
    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    val_prompts, layers = args.val_prompts, args.drafter_layers
    train_answers = val_answers = None
    if toy_run:  # built-in toy: scaffolding from toy.py, not part of the method
        # one toy for every run, wherever --out puts the drafter: the same target and the same
        # answers, checked against toy.json
        if rank == 0:
            print(
                f"[toy] target and its answers from {paths['target']}; the drafter goes to {args.out}"
            )
        if args.prompts is None:
            train_answers = paths["train_answers"]
        else:
            cli.read_jsonl("--prompts", args.prompts)
        if val_prompts is None:
            val_answers = paths["test_answers"]
        else:
            cli.read_jsonl("--val-prompts", val_prompts)
        args.target = paths["target"]
        if args.prompts is None:
            args.prompts = paths["train"]
        if args.data_dir is None:
            args.data_dir = TOY_RUNS
        if val_prompts is None:
            val_prompts = paths["test"]
        if layers is None:
            # the target's first 2 layers, the plain prefix (LAB.md, exercise 5, compares others)
            layers = "0,1"
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data_dir = args.data_dir or os.path.dirname(os.path.abspath(args.out))
    data = dict(
        tokenizer=tokenizer,
        prompt_field=args.prompt_field,
        thinking=args.thinking,
        cache_dir=data_dir,
        max_new_tokens=args.max_new_tokens,
        gen_batch_size=args.gen_batch_size,
        device=device,
        dtype=torch.bfloat16 if bf16 else None,
        rank=rank,
        world=world,
    )
    train = answers.load_data(
        args.target,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        answers=train_answers,
        **data,
    )
    if val_prompts:
        val = answers.load_data(
            args.target, prompts=val_prompts, num_prompts=args.num_val, answers=val_answers, **data
        )
    else:
        num_val = min(args.num_val, round(len(train) * args.val_fraction))
        train, val = train[: len(train) - num_val], train[len(train) - num_val :]

    target_vocab_size = AutoConfig.from_pretrained(args.target).get_text_config().vocab_size
    # FSDP: rank 0 alone reads the weights, the others get shards (distributed.shard_model)
    on_meta = args.fsdp and rank > 0
    drafter = build_drafter(
        args.drafter_init or args.target,
        tokenizer,
        target_vocab_size=target_vocab_size,
        layers=layers,
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
        params = sum(p.numel() for p in drafter.parameters())
        init = (
            f"{args.drafter_init or args.target}{' (random weights)' if args.random_init else ''}"
        )
        print(
            f"[drafter] {init}, layers {drafter.d3d_config.layer_ids or 'all'}, "
            f"{params / 1e6:.1f}M parameters; {len(train)} training and {len(val)} held-out answers"
        )
        if args.ar_weight == 0 and args.d1_from == "causal":
            print(
                "[drafter] note: --ar-weight 0 trains no next-token head, yet d_1 comes from it (--d1-from "
                "causal); --d1-from mask drafts d_1 from MASK 1, which the block loss does train"
            )
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    result = train_drafter(
        drafter,
        train,
        val,
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
        num_anchors=args.num_anchors,
        block_size=args.block_size,
        ar_weight=args.ar_weight,
        decay_gamma=args.decay_gamma,
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
        init=runtime.record_path(args.drafter_init or args.target),
    )

    peak = memory.peak_memory_gib(device)
    # the same held-out blocks with d_1 drafted by MASK 1 instead of the causal next-token head, or the reverse
    other = "mask" if drafter.d3d_config.d1_from == "causal" else "causal"
    settings = dict(
        block_size=args.block_size,
        num_anchors=args.val_anchors,
        pad_id=pad_id,
        max_len=args.max_len,
        d1_from=other,
    )
    sharded = result.pop("sharded", None)
    if (
        sharded is not None
    ):  # every rank evaluates the sharded drafter, then all gather it once, onto rank 0's host
        result[f"offline_tau_d1_from_{other}"] = evaluation.evaluate_tau(
            drafter, val, sharded=sharded, **settings
        )
        drafter = (
            distributed.gather_drafter(sharded, drafter) or drafter
        )  # ranks > 0 keep their shards
    if bf16 and (
        rank == 0 or sharded is None
    ):  # the final drafter in the dtype it was trained in (the fp32 master
        drafter.model.to(torch.bfloat16)  # weights stay in the checkpoint)
    if rank == 0:
        if sharded is None:
            autocast = (
                (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
                if bf16
                else contextlib.nullcontext
            )
            result[f"offline_tau_d1_from_{other}"] = evaluation.evaluate_tau(
                drafter, val, autocast=autocast, **settings
            )
        drafter.save_pretrained(args.out, tokenizer=tokenizer)
        # the toy's files relative to the repository, a user's as given (runtime.record_path)
        target = runtime.record_path(args.target)
        record = {
            **vars(args),
            "target": target,
            "toy": runtime.record_path(args.toy),
            "prompts": runtime.record_path(args.prompts),
            "val_prompts": runtime.record_path(val_prompts),
            "answers": runtime.record_path(train_answers),
            "val_answers": runtime.record_path(val_answers),
            "layer_ids": drafter.d3d_config.layer_ids,
            **result,
            "peak_memory_gib": round(peak, 2),
            "device": str(device),
            "world_size": world,
            "compute_dtype": "bfloat16" if bf16 else "float32",
            "fsdp": args.fsdp,
        }
        with open(os.path.join(args.out, "train_args.json"), "w") as f:
            json.dump(record, f, indent=2)
        print(
            f"[done] offline tau (B={args.block_size}) on {len(val)} held-out answers: {result['offline_tau']:.3f} "
            f"(d_1 from {'the causal next-token head' if other == 'mask' else 'MASK 1'}; "
            f"{result[f'offline_tau_d1_from_{other}']:.3f} from {'MASK 1' if other == 'mask' else 'the head'}); "
            f"training {result['train_seconds']:.0f} s; peak memory {peak:.2f} GiB "
            f"({'GPU allocated' if device.type == 'cuda' else 'RSS'})"
        )
        kept = (
            f"{distributed.SHARDED_CHECKPOINT}/ resumes"
            if args.fsdp
            else "checkpoint.pt and optimizer-*.pt resume"
        )
        print(
            f"[done] target: {target}\n[done] answer caches: {data_dir}\n[done] drafter (+ train_args.json; "
            f"{kept} or extend the run): {os.path.abspath(args.out)}"
        )
    distributed.end_process_group()
    return {**result, "drafter": drafter, "out": args.out}


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
