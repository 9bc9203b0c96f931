"""Train a D3D drafter on answers written by the target itself (paper "Drafter training", Fig. 1a).

    python train.py                                   # built-in toy on CPU, no download: runs/toy/drafter
    python train.py --seed 1 --ar-weight 0 --first-token mask --out runs/lab/lam0   # a toy ablation (LAB.md)
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
import collections
import contextlib
import copy
import datetime
import functools
import glob
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import batched
import d3d
import fast
import runtime
import toy

try:
    import resource  # peak RSS on Linux and macOS; Windows has no such module
except ImportError:
    resource = None

MAX_SKIPPED_IN_A_ROW = 5  # steps in a row with a non-finite gradient before training stops: the run has diverged

TOY_RUNS = "runs/toy"  # the toy's runs: the default drafter, and answers to any prompts the toy does not ship

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Does the device compute bf16 natively (CUDA: the GPU says; CPU: AVX512-BF16 or AMX in /proc/cpuinfo)?
    Elsewhere bf16 matmuls fall back to slow kernels (measured: ~20-200x slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype of both drivers: "auto" (or None) is bf16 where the device does it natively, else fp32; an explicit
    bf16 on a CPU without it is honoured with a warning."""
    if name in (None, "auto"):
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    if DTYPES[name] == torch.bfloat16 and device.type == "cpu" and not native_bf16(device):
        warnings.warn("bf16 on a CPU without AVX512-BF16/AMX runs on slow fallback kernels (measured on AVX2: a "
                      "drafter training step 130 s instead of 5.9 s in fp32); --dtype auto picks fp32 here")
    return DTYPES[name]


# ----------------------------------------------------------------------------------------------------------------------
# Data: prompts -> the target's own greedy answers, cached as token ids


def read_prompts(path: str, field: str) -> list[list[dict]]:
    """One chat (list of messages) per JSON line. `field` holds a string, a list of turns (the first is used: later
    turns follow the target's own reply, which we do not have yet) or a list of {"role", "content"} messages."""
    chats = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if field not in row:
                raise ValueError(f"{path} line {n} has no field {field!r} (its fields: {sorted(row)}); "
                                 "name the prompt field with --prompt-field")
            value = row[field]
            if isinstance(value, list) and value and isinstance(value[0], dict):
                chats.append(value[:-1] if value[-1].get("role") == "assistant" else value)
            elif isinstance(value, list) and value:
                chats.append([{"role": "user", "content": str(value[0])}])
            else:
                chats.append([{"role": "user", "content": str(value)}])
    return chats


def load_target(path: str, device, dtype=None):
    """The frozen target, in eval mode, loaded straight to the device in `dtype` (a function of its own so tests can
    count the calls)."""
    return runtime.load_causal_lm(path, dtype, device).eval()


def answers_header(target: str, tokenizer, max_new_tokens: int) -> dict:
    """The first line of an answers file: whose answers, in which tokenizer's ids, cut at how many tokens."""
    return {"answers_of": target, "tokenizer": runtime.tokenizer_fingerprint(tokenizer),
            "max_new_tokens": max_new_tokens}


def _read_cache(paths: list[str], tokenizer) -> dict[int, tuple[list[int], list[int]]]:
    """{prompt index: (prompt ids, response ids)} from answers files; a file written in another tokenizer's ids is an
    error (its ids would mean other text)."""
    done, mine = {}, runtime.tokenizer_fingerprint(tokenizer)
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if not line.endswith("\n"):  # a line cut by a kill is answered again
                        continue
                    row = json.loads(line)
                    if "answers_of" in row:
                        if row["tokenizer"] != mine:
                            raise ValueError(f"{path} holds the answers of {row['answers_of']} in the ids of a "
                                             f"tokenizer with fingerprint {row['tokenizer']}, but this tokenizer's is "
                                             f"{mine}: its ids would decode to other text. Use the target that wrote "
                                             "it, or delete the file to answer again")
                        continue
                    done[row["i"]] = (row["prompt"], row["response"])
    return done


class _Throughput:
    """A transformers streamer that shows the new tokens per second of the unfinished rows, at every step."""

    def __init__(self, bar, eos: set[int]):
        self.bar, self.eos, self.num_tokens, self.start = bar, torch.tensor(sorted(eos)), 0, time.perf_counter()

    def put(self, tokens: torch.Tensor):
        if tokens.dim() == 2:  # generate hands over the prompts first
            self.alive = torch.ones(tokens.shape[0], dtype=torch.bool)
            return
        self.num_tokens += int(self.alive.sum())
        self.alive &= ~torch.isin(tokens, self.eos)
        self.bar.set_postfix(tok_per_s=f"{self.num_tokens / (time.perf_counter() - self.start):.0f}", refresh=False)
        self.bar.update(0)  # redraws at most every bar.mininterval seconds

    def end(self):
        pass


@torch.no_grad()
def answer_prompts(target_path: str, tokenizer, prompt_ids: list[list[int]], cache: str, *, max_new_tokens: int,
                   batch_size: int, device, dtype=None, rank: int = 0, world: int = 1) -> list[list[int]]:
    """The target's greedy response (token ids, ending with EOS when it stopped) to each prompt. Every finished
    batch is appended to `cache` (under DDP each rank answers its share into cache.rankR), so a rerun resumes."""
    parts = [cache] + sorted(glob.glob(glob.escape(cache) + ".rank*"))
    done = _read_cache(parts, tokenizer)
    todo = [i for i, p in enumerate(prompt_ids) if i not in done or done[i][0] != p][rank::world]
    if todo:
        target = load_target(target_path, device, dtype)
        eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
        eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(eos),
                                      pad_token_id=pad)  # fresh: the checkpoint's sampling defaults do not apply
        todo.sort(key=lambda i: len(prompt_ids[i]))  # similar lengths in a batch: little left padding
        bar = tqdm(total=len(todo), desc="target answers", unit="prompt", disable=rank > 0)
        throughput = _Throughput(bar, eos)
        mine = cache if world == 1 else f"{cache}.rank{rank}"
        if os.path.exists(mine):  # drop a line cut by a kill, or the next one would be glued to it
            with open(mine, "rb+") as f:
                f.truncate(f.read().rfind(b"\n") + 1)
        with open(mine, "a") as f:
            if f.tell() == 0:
                f.write(json.dumps(answers_header(target_path, tokenizer, max_new_tokens)) + "\n")
            for s in range(0, len(todo), batch_size):
                idx = todo[s: s + batch_size]
                # left padding: every prompt ends where its answer begins
                ids, real = batched.left_pad([prompt_ids[i] for i in idx], device)
                out = target.generate(input_ids=ids, attention_mask=real.long(), generation_config=gen_config,
                                      streamer=throughput)[:, ids.shape[1]:].tolist()
                for i, response in zip(idx, out):
                    stop = next((k for k, t in enumerate(response) if t in eos), None)
                    response = response if stop is None else response[: stop + 1]  # keep EOS, drop padding
                    f.write(json.dumps({"i": i, "prompt": prompt_ids[i], "response": response}) + "\n")
                f.flush()
                bar.update(len(idx))
        bar.close()
        del target
    if world > 1:
        dist.barrier()  # every rank's share is on disk
    done = _read_cache([cache] + sorted(glob.glob(glob.escape(cache) + ".rank*")), tokenizer)
    return [done[i][1] for i in range(len(prompt_ids))]


def load_data(target: str, tokenizer, prompts: str, *, prompt_field: str = "question", num_prompts: int | None = None,
              thinking: bool = False, cache_dir: str = ".", max_new_tokens: int = 256, gen_batch_size: int = 64,
              device="cpu", dtype=None, rank: int = 0, world: int = 1,
              answers: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) for the first `num_prompts` prompts of a JSON Lines file, answered by the target;
    `answers`: a file of the target's answers to these prompts (the toy's), read as it is, never written."""
    chats = read_prompts(prompts, prompt_field)[:num_prompts]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
             for c in chats]
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]  # the template has the specials
    if answers is not None:
        done = _read_cache([answers], tokenizer)
        for i, p in enumerate(prompt_ids):
            if i not in done or done[i][0] != p:
                why = "no answer" if i not in done else "its prompt ids differ"
                raise ValueError(f"{answers} does not answer line {i + 1} of {prompts} ({why}): the answers belong "
                                 "to other prompts, another chat template or another tokenizer")
        return [(p, done[i][1]) for i, p in enumerate(prompt_ids)]
    # the cache belongs to one target and one generation setting; the prompts are checked line by line
    key = json.dumps([os.path.abspath(target) if os.path.exists(target) else target,
                      runtime.tokenizer_fingerprint(tokenizer), max_new_tokens])
    name = os.path.splitext(os.path.basename(prompts))[0]
    cache = os.path.join(cache_dir, f"answers-{name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.jsonl")
    os.makedirs(cache_dir, exist_ok=True)
    responses = answer_prompts(target, tokenizer, prompt_ids, cache, max_new_tokens=max_new_tokens,
                               batch_size=gen_batch_size, device=device, dtype=dtype, rank=rank, world=world)
    if rank == 0:
        print(f"[data] {len(chats)} answers of the target to {prompts} in {cache}")
    return list(zip(prompt_ids, responses))


def collate(examples, pad_id: int, max_len: int):
    """Right-padded input_ids (b, L) and loss_mask (b, L): True on response tokens only (not prompt, not padding)."""
    seqs = [(p + r)[:max_len] for p, r in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, ((prompt, _), seq) in enumerate(zip(examples, seqs)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        loss_mask[row, len(prompt): len(seq)] = True
    return input_ids, loss_mask


# ----------------------------------------------------------------------------------------------------------------------
# Drafter: a pretrained causal LM with the target's tokenizer, some of its layers kept


def select_layers(num_layers: int, spec) -> list[int] | None:
    """`spec`: None (all), a count N (evenly spaced over the depth, first and last kept) or explicit ids "0,14,29"."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str) and "," in spec or isinstance(spec, (list, tuple)):
        ids = [int(i) for i in (spec.split(",") if isinstance(spec, str) else spec)]
        if any(not 0 <= i < num_layers for i in ids):
            raise ValueError(f"layer ids {ids} out of range: the drafter-init has {num_layers} layers")
        return ids
    n = int(spec)
    if not 1 <= n <= num_layers:
        raise ValueError(f"--drafter-layers {n}: the drafter-init has {num_layers} layers")
    if n == 1:
        return [num_layers - 1]
    return [round(k * (num_layers - 1) / (n - 1)) for k in range(n)]


def build_drafter(drafter_init: str, tokenizer, *, target_vocab_size: int, layers=None, random_init: bool = False,
                  meta: bool = False, **config) -> d3d.Drafter:
    """d3d.make_drafter on `drafter_init` after checking that it speaks the target's tokenizer; with `random_init`,
    its architecture with freshly initialised weights (from torch's current seed). With `meta`, the same drafter
    (names, shapes, layer cut, MASK row) on the meta device: no weights read, no memory (a rank > 0 under --fsdp,
    which receives its shards from rank 0: shard_model)."""
    try:
        init_tokenizer = AutoTokenizer.from_pretrained(drafter_init)
    except (OSError, ValueError):  # no tokenizer saved with it: make_drafter still checks the vocabulary size
        init_tokenizer = None
    fingerprint = runtime.tokenizer_fingerprint
    if init_tokenizer is not None and fingerprint(init_tokenizer) != fingerprint(tokenizer):
        raise ValueError(f"--drafter-init {drafter_init} uses a different tokenizer than the target: its token ids "
                         "mean other text. Initialise the drafter from a checkpoint of the target's family")
    if random_init or meta:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(drafter_init), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(drafter_init, dtype=torch.float32)  # fp32 master weights
    layer_ids = select_layers(model.config.get_text_config().num_hidden_layers, layers)
    drafter = d3d.make_drafter(model, tokenizer=tokenizer, layers=layer_ids, target_vocab_size=target_vocab_size,
                               **config)
    if os.path.isfile(os.path.join(drafter_init, d3d.CONFIG_NAME)):  # training on from a drafter: keep its layer ids
        kept = d3d.D3DConfig.load(drafter_init).layer_ids
        if kept is not None:
            drafter.d3d_config.layer_ids = [kept[i] for i in (layer_ids or range(len(kept)))]
    return drafter


def freeze_embeddings(drafter: d3d.Drafter, hook: bool = True,
                      device=None) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """Freeze the input embeddings and the output layer, except the MASK row (a new token must learn its vector).
    Returns the embedding weight and its row mask (1 = trains); with `hook`, a gradient hook applies the mask. Under
    FSDP no autograd hook can: fully_shard replaces the parameter (a hook registered before is dropped) and writes
    the reduced gradient of the sharded one straight into .grad (a hook on it never fires), so sharded training
    calls it with hook=False before fully_shard, then freeze_sharded_rows on the sharded parameter. The mask goes to
    `device` (default the weight's; a drafter on the meta device has its weights elsewhere)."""
    weight = drafter.model.get_input_embeddings().weight
    keep = torch.zeros(weight.shape[0], 1, device=device or weight.device)
    keep[drafter.d3d_config.mask_token_id] = 1.0
    if hook:
        weight.register_hook(lambda grad: grad * keep.to(grad.dtype))
    head = drafter.model.get_output_embeddings().weight
    if head is not weight:  # untied output layer: frozen whole (its MASK row is never used)
        head.requires_grad_(False)
    return weight, keep


def freeze_sharded_rows(weight: torch.nn.Parameter, keep: torch.Tensor) -> None:
    """freeze_embeddings' row mask on a sharded (FSDP2, DTensor) embedding, registered after fully_shard on the
    sharded parameter: FSDP2 runs its post-accumulate-grad hooks itself once the reduced gradient shard is in .grad
    (a plain tensor hook on it never fires: autograd only sees the gathered copy). The mask is cut the way the
    weight is (torch.chunk of dim 0: rank r holds rows r*ceil(V/N) on), so each rank zeroes its own frozen rows;
    AdamW then moves them not at all (zero moments, no weight decay in their group), as with the hook."""
    local = distribute_tensor(keep, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
    if local.shape[0] != weight.to_local().shape[0]:
        raise RuntimeError(f"frozen-row mask has {local.shape[0]} rows, the local shard {weight.to_local().shape[0]}:"
                           " FSDP sharded the embedding another way")
    weight.register_post_accumulate_grad_hook(lambda param: param.grad.to_local().mul_(local.to(param.grad.dtype)))


# ----------------------------------------------------------------------------------------------------------------------
# Training


def save_checkpoint(out: str, step: int, training_state: dict, optimizer_state: dict) -> None:
    """A resumable checkpoint in pieces, each written beside its old version and renamed over it (a reader never
    sees half a file): checkpoint.pt (fp32 weights, step, schedule, RNG, AdamW's step counts and settings), then one
    optimizer-KEY.pt per AdamW moment (exp_avg, exp_avg_sq), each the size of the weights. Only one piece is doubled
    at a time, so a save needs the spare disk of one piece, never of a second checkpoint (a ~2B-parameter drafter:
    3 x 8 GB on disk, 32 GB at the peak of a save instead of 48). A kill between two renames leaves some moments one
    save behind the weights; the resume says so and goes on with them. Plain types only (tensors, numbers, strings,
    containers of them): load_checkpoint reads with weights_only=True, which unpickles no other class."""
    os.makedirs(out, exist_ok=True)
    moments = collections.defaultdict(dict)  # key -> {parameter index: tensor}
    for index, per_param in optimizer_state["state"].items():
        for key, value in per_param.items():
            moments[key][index] = value
    steps = moments.pop("step", {})  # small: kept with the weights
    pieces = {"checkpoint.pt": {**training_state, "param_groups": optimizer_state["param_groups"],
                                "adam_steps": steps, "moment_keys": sorted(moments)}}
    pieces.update({f"optimizer-{key}.pt": value for key, value in moments.items()})
    for name, piece in pieces.items():
        path = os.path.join(out, name)
        torch.save({"step": step, "piece": piece}, path + ".tmp")
        os.replace(path + ".tmp", path)


def load_checkpoint(out: str) -> tuple[dict, dict | None]:
    """(training state, AdamW state dict or None) from save_checkpoint's pieces; ({}, None) if there are none. Read
    into host memory: the model's and the optimizer's load_state_dict copy each tensor to its parameter's device,
    and AdamW's step counts stay on the CPU, where its (not capturable) update reads them."""
    path = os.path.join(out, "checkpoint.pt")
    if not os.path.exists(path):
        return {}, None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if "piece" not in saved:
        raise ValueError(f"{path} is not a checkpoint of this train.py: move it away or rerun with --no-resume")
    state, step = saved["piece"], saved["step"]
    moments = {}
    for key in state["moment_keys"]:
        piece_path = os.path.join(out, f"optimizer-{key}.pt")
        if not os.path.exists(piece_path):
            print(f"[train] {piece_path} is missing: resuming with fresh AdamW moments")
            return {**state, "step": step}, None
        piece = torch.load(piece_path, map_location="cpu", weights_only=True)
        if piece["step"] != step:
            print(f"[train] AdamW {key} is from step {piece['step']}, the weights from step {step} (a save was cut "
                  "short): resuming with it")
        moments[key] = piece["piece"]
    per_param = {index: {"step": count, **{key: moments[key][index] for key in moments}}
                 for index, count in state["adam_steps"].items()}
    return {**state, "step": step}, {"state": per_param, "param_groups": state["param_groups"]}


SHARDED_CHECKPOINT = "checkpoint-fsdp"  # under --fsdp: a torch.distributed.checkpoint folder, one file per process


def save_sharded_checkpoint(out: str, step: int, model: torch.nn.Module, optimizer, training_state: dict) -> None:
    """--fsdp's checkpoint, by every process together: torch.distributed.checkpoint (DCP) writes the weights and
    AdamW state, each process its own shards, into out/checkpoint-fsdp.tmp, with train_state.pt (step, schedule,
    skipped steps, every rank's RNG, world size); once all is written, rank 0 renames the folder over the last one
    (the disk of two checkpoints at the peak of a save, unlike the piecewise checkpoint.pt). DCP stores each tensor
    with its global shape, so any number of processes can load it. train_state.pt holds plain types only, as
    save_checkpoint's pieces."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(out, SHARDED_CHECKPOINT)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    rngs = [None] * world
    dist.all_gather_object(rngs, (torch.get_rng_state(), random.getstate()))
    if rank == 0:
        shutil.rmtree(path + ".tmp", ignore_errors=True)  # a save cut short
        os.makedirs(out, exist_ok=True)
    dist.barrier()
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path + ".tmp")
    if rank == 0:
        torch.save({**training_state, "step": step, "world": world, "rngs": rngs},
                   os.path.join(path + ".tmp", "train_state.pt"))
        if os.path.exists(path):  # a kill between the two renames leaves .old whole: load_sharded_checkpoint reads it
            shutil.rmtree(path + ".old", ignore_errors=True)
            os.replace(path, path + ".old")
        os.replace(path + ".tmp", path)
        shutil.rmtree(path + ".old", ignore_errors=True)
    dist.barrier()


def load_sharded_checkpoint(out: str, model: torch.nn.Module, optimizer) -> dict:
    """Load save_sharded_checkpoint's folder into the sharded model and optimizer, by every process together; the
    training state ({} if there is no checkpoint). With the world size it was saved with, each rank takes back its
    own RNG; with another, rank 0's (the data order then follows the new sharding of the data, train[rank::world])."""
    path = os.path.join(out, SHARDED_CHECKPOINT)
    if not os.path.exists(os.path.join(path, "train_state.pt")) and os.path.exists(path + ".old"):
        path += ".old"
    if not os.path.exists(os.path.join(path, "train_state.pt")):
        if os.path.exists(os.path.join(out, "checkpoint.pt")):
            raise ValueError(f"{out} holds a checkpoint of a run without --fsdp (checkpoint.pt): resume it without "
                             "--fsdp, or start afresh with --no-resume")
        return {}
    state = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch_rng, python_rng = state["rngs"][rank if world == state["world"] else 0]
    return {**state, "rng": torch_rng, "python_rng": python_rng, "path": path}


def shard_model(model: torch.nn.Module, decoder_layers, bf16: bool, device: torch.device) -> None:
    """FSDP2 (fully_shard) on each decoder layer, then on the root (embeddings, final norm, head): each process keeps
    1/N of the fp32 weights, gradients and AdamW moments, and a layer is all-gathered only for its forward and
    backward. bf16 by FSDP2's MixedPrecisionPolicy rather than autocast: the all-gather moves and holds bf16 copies
    (half the traffic and the memory of an unsharded layer) and each matmul reads them as they are, where autocast
    would gather fp32 and cast at every op; gradients are reduced in fp32 into the fp32 master shards.
    On several processes only rank 0 holds the weights (ranks > 0 built the model on the meta device: one host copy,
    not one a process); they reach every rank's shards on `device` by broadcast_from_rank0."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    several = dist.get_world_size() > 1
    full = model.state_dict() if several and dist.get_rank() == 0 else {}  # references to the weights, no copy
    for layer in decoder_layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if several:
        broadcast_from_rank0(model, full, device)


def non_persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict leaves out (rotary frequencies), by name."""
    return [(name, buffer) for name, buffer in module.named_buffers()
            if name.rpartition(".")[2] in module.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set]


def broadcast_from_rank0(model: torch.nn.Module, full: dict, device: torch.device) -> None:
    """Rank 0's whole state dict `full` into every rank's shards of the sharded `model`, one tensor at a time (so no
    rank but 0 ever holds more than one whole tensor); ranks > 0 first allocate their shards (empty) on `device` in
    place of the meta tensors. The buffers outside the state dict follow whole from rank 0: to_empty leaves them
    uninitialised on ranks > 0."""
    if dist.get_rank() > 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for _, buffer in non_persistent_buffers(model):
        dist.broadcast(buffer, src=0)


def gather_drafter(model: torch.nn.Module, drafter: d3d.Drafter) -> d3d.Drafter | None:
    """The sharded drafter gathered once into host memory (every process takes part): an ordinary d3d.Drafter on
    rank 0, None elsewhere. Built on the meta device and filled with the gathered weights, so the host holds one
    copy; the buffers not in the state dict (rotary frequencies) are copied from the sharded model, which keeps them
    whole."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    full = {key.removeprefix("drafter."): value for key, value in full.items()}
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(drafter.model.config, dtype=torch.float32)
    plain = d3d.Drafter(hf_model, copy.deepcopy(drafter.d3d_config))
    missing, unexpected = plain.load_state_dict(full, strict=False, assign=True)
    if unexpected or set(missing) - {"model.lm_head.weight"}:
        raise RuntimeError(f"gathered drafter: missing {missing}, unexpected {unexpected}")
    if missing:  # tied output layer: the gathered state holds the embedding once
        plain.model.lm_head.weight = plain.model.get_input_embeddings().weight
    for name, buffer in non_persistent_buffers(drafter):
        module_name, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(module_name), leaf, buffer.detach().to("cpu", copy=True))
    return plain.train(drafter.training)


def peak_memory_gib(device, reset: bool = False) -> float:
    """Peak memory so far: CUDA, allocated by PyTorch (since the last reset); CPU, the process's peak RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    if resource is None:
        return float("nan")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


@torch.no_grad()
def evaluate_tau(drafter, examples, *, block_size: int, num_anchors: int = 32, batch_size: int = 8, pad_id: int,
                 max_len: int = 1024, autocast=contextlib.nullcontext, seed: int = 0, first_token=None,
                 per_block: bool = False, sharded: torch.nn.Module | None = None):
    """Mean offline tau (accepted + 1) over blocks drafted at `num_anchors` sampled points per held-out answer (with
    per_block: the tau of every block, a tensor); d_1 from where the drafter's config says (first_token overrides:
    "causal" or "mask"). `sharded`: the FSDP root (a TrainingLoss) around `drafter`; every pass goes through its
    forward, which gathers the weights, so every process must evaluate, on the same examples."""
    generator = torch.Generator().manual_seed(seed)  # the same anchors at every evaluation
    was_training, taus = drafter.training, []
    drafter.eval()
    # under FSDP every pass goes through the root's forward, which gathers the weights
    run = functools.partial(sharded, fn=d3d.offline_tau) if sharded is not None else \
        functools.partial(d3d.offline_tau, drafter)
    for s in tqdm(range(0, len(examples), batch_size), desc=f"offline tau B={block_size}", leave=False):
        input_ids, loss_mask = collate(examples[s: s + batch_size], pad_id, max_len)
        with autocast():
            taus.append(run(input_ids.to(drafter.device), loss_mask.to(drafter.device), num_anchors=num_anchors,
                            block_size=block_size, first_token=first_token, generator=generator))
    if sharded is not None:
        sharded.reshard()  # the root stays gathered after a forward that no backward follows
    drafter.train(was_training)
    return torch.cat(taus) if per_block else torch.cat(taus).mean().item()


def acceptance_curve(taus: torch.Tensor, block_size: int) -> list[float]:
    """Per block position i = 1..B: the share of blocks whose drafts d_1 .. d_i were all accepted (tau > i)."""
    return [(taus > i).float().mean().item() for i in range(1, block_size + 1)]


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


def train_drafter(drafter: d3d.Drafter, train, val, *, out: str, steps: int, batch_size: int, grad_accum: int,
                  lr: float, warmup: int, weight_decay: float, grad_clip: float, freeze: bool, pad_id: int,
                  max_len: int, num_anchors: int, block_size: int, ar_weight: float, decay_gamma: float | None,
                  eval_every: int, val_anchors: int, save_every: int, seed: int, bf16: bool, resume: bool = True,
                  rank: int = 0, world: int = 1, fsdp: bool = False, device: torch.device | None = None) -> dict:
    """AdamW (warmup then cosine to 10 %) on d3d_loss; `batch_size` sequences per micro-batch and rank, `grad_accum`
    micro-batches per step. Checkpoints every `save_every` steps (save_checkpoint; with `fsdp`,
    save_sharded_checkpoint); resumes from them if present. With `fsdp` (a process group must be up) the drafter is
    sharded in place and returned as "sharded" (its FSDP root) with the result; every process evaluates and saves.
    `device`: where to train, default the drafter's (a rank > 0 under `fsdp` holds it on the meta device until
    shard_model fills its shards from rank 0)."""
    device = device or drafter.device
    # FSDP casts to bf16 itself (shard_model); DDP and one process autocast around fp32 weights
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 and not fsdp else \
        contextlib.nullcontext
    frozen, keep = freeze_embeddings(drafter, hook=not fsdp, device=device) if freeze else (None, None)
    model = TrainingLoss(drafter)
    if fsdp:
        shard_model(model, drafter.model.get_decoder().layers, bf16, device)
        if freeze:  # fully_shard replaced the parameter, dropping the hooks of the old one
            frozen = drafter.model.get_input_embeddings().weight
            freeze_sharded_rows(frozen, keep)
    elif world > 1:  # PyTorch's own DDP: gradients all-reduced in backward
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    decayed = [p for p in drafter.parameters() if p.requires_grad and p is not frozen]
    groups = [{"params": decayed, "weight_decay": weight_decay}] + ([{"params": [frozen], "weight_decay": 0.0}]
                                                                    if frozen is not None else [])
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    schedule = lambda s: min(1.0, (s + 1) / max(warmup, 1)) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s / steps, 1))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    start_step, skipped, skipped_in_a_row = 0, 0, 0  # steps dropped for a non-finite gradient (runtime.finite_step)
    if fsdp:
        state = load_sharded_checkpoint(out, model, optimizer) if resume else {}
    else:
        if resume and not os.path.exists(os.path.join(out, "checkpoint.pt")) and \
                os.path.isdir(os.path.join(out, SHARDED_CHECKPOINT)):
            raise ValueError(f"{out} holds a checkpoint of an --fsdp run ({SHARDED_CHECKPOINT}): resume it with "
                             "--fsdp (any number of processes), or start afresh with --no-resume")
        state, optimizer_state = load_checkpoint(out) if resume else ({}, None)
        if state:
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
            print(f"[train] resumed from {state.get('path') or os.path.join(out, 'checkpoint.pt')} at step "
                  f"{start_step}{saved_by}")

    shard = train[rank::world]  # each rank its own sequences
    per_epoch = math.ceil(len(shard) / batch_size)
    anchors_rng = torch.Generator()

    def micro_batch(m: int):  # the m-th micro-batch of this rank: a function of m only, so a resume continues exactly
        epoch, k = divmod(m, per_epoch)
        order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
        anchors_rng.manual_seed((seed * 1_000_003 + m) * world + rank)
        input_ids, loss_mask = collate([shard[i] for i in order[k * batch_size: (k + 1) * batch_size]], pad_id, max_len)
        return input_ids.to(device), loss_mask.to(device)

    history, tau, loss_ema, start = [], float("nan"), None, time.perf_counter()

    def evaluate(done: int) -> float:
        tau = evaluate_tau(drafter, val, block_size=block_size, num_anchors=val_anchors, pad_id=pad_id,
                           max_len=max_len, autocast=autocast, sharded=model if fsdp else None)
        history.append({"step": done, "loss": loss_ema and round(loss_ema, 4), "offline_tau": round(tau, 3),
                        "skipped": skipped})
        if rank == 0:
            tqdm.write(f"[train] step {done}: loss {loss_ema or float('nan'):.3f}, offline tau (B={block_size}) "
                       f"{tau:.3f}{f', {skipped} steps skipped (non-finite gradient)' if skipped else ''}")
        return tau

    drafter.train()
    bar = tqdm(range(start_step, steps), initial=start_step, total=steps, desc="train drafter", disable=rank > 0)
    for step in bar:
        num_tokens, step_start = 0, time.perf_counter()
        for a in range(grad_accum):
            input_ids, loss_mask = micro_batch(step * grad_accum + a)
            num_tokens += int((input_ids != pad_id).sum())
            last = a == grad_accum - 1
            # DDP: all-reduce once per step. FSDP reduce-scatters every micro-batch: skipping it would keep whole
            # unsharded gradients between micro-batches, the memory sharding saves
            with (model.no_sync() if world > 1 and not fsdp and not last else contextlib.nullcontext()):
                with autocast():
                    loss, metrics = model(input_ids, loss_mask, num_anchors=num_anchors, block_size=block_size,
                                          ar_weight=ar_weight, decay_gamma=decay_gamma, generator=anchors_rng)
                (loss / grad_accum).backward()
        # a NaN or Inf never reaches AdamW. FSDP: clip_grad_norm_ of DTensor gradients returns a replicated DTensor,
        # the norm over all shards, so every rank reads the same value and decides alike
        stepped = runtime.finite_step(optimizer, drafter.parameters(), grad_clip)
        scheduler.step()  # on a skipped step too: the rate stays a function of the step number, as a resume assumes
        skipped_in_a_row = 0 if stepped else skipped_in_a_row + 1
        skipped += not stepped
        if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise RuntimeError(f"step {step + 1}: {skipped_in_a_row} steps in a row had a non-finite gradient "
                               f"({skipped} skipped in all); training has diverged. Lower --lr, use --dtype float32, "
                               "or check the data for empty or corrupt answers")
        if stepped:  # a NaN loss would stay in the running mean for good
            loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{loss_ema or float('nan'):.3f}", block=f"{metrics['loss_block']:.2f}",
                        ar=f"{metrics['loss_ar']:.2f}", block_acc=f"{metrics['block_acc'].mean():.3f}",
                        acc1=f"{metrics['block_acc'][0]:.2f}",
                        tok_per_s=f"{num_tokens * world / (time.perf_counter() - step_start):.0f}",
                        peak_gib=f"{peak_memory_gib(device, reset=True):.2f}",  # CUDA: this step's; CPU: the run's
                        skipped=skipped)
        done = step + 1
        if (rank == 0 or fsdp) and val and done % eval_every == 0 and done < steps:  # FSDP: every rank's pass
            evaluate(done)
        if fsdp and (done % save_every == 0 or done == steps):
            save_sharded_checkpoint(out, done, model, optimizer, {"scheduler": scheduler.state_dict(),
                                                                 "skipped": skipped})
        elif rank == 0 and (done % save_every == 0 or done == steps):
            save_checkpoint(out, done, {"model": drafter.state_dict(), "scheduler": scheduler.state_dict(),
                                        "rng": torch.get_rng_state(), "python_rng": random.getstate(),
                                        "skipped": skipped}, optimizer.state_dict())
    bar.close()
    if (rank == 0 or fsdp) and val:  # also when a rerun finds the run finished: evaluates with the new --num-val, ...
        tau = evaluate(steps)
    return {"offline_tau": tau, "history": history, "skipped_steps": skipped,
            "train_seconds": round(time.perf_counter() - start, 1), **({"sharded": model} if fsdp else {})}


# ----------------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_argument_group("data")
    g.add_argument("--target", help="target model: HF folder or hub name (default: the toy, --toy)")
    g.add_argument("--toy", default=toy.SHIPPED, help="toy folder, when no --target: its target, prompts and answers, "
                                                      "checked against its toy.json (default: the repository's, "
                                                      "toy-target/; `python toy.py` builds others)")
    g.add_argument("--prompts", help="JSON Lines file of training prompts (default: the toy's train prompts)")
    g.add_argument("--prompt-field", default="question", help="field holding the prompt (default: question)")
    g.add_argument("--val-prompts", help="JSON Lines file of held-out prompts (default: toy test prompts, "
                                         "else --val-fraction of --prompts)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of --prompts held out when there is no "
                                                                     "--val-prompts (default: 0.05)")
    g.add_argument("--num-prompts", type=int, help="use the first N training prompts (default: all)")
    g.add_argument("--num-val", type=int, default=200, help="use the first N held-out prompts (default: 200)")
    g.add_argument("--thinking", action="store_true", help="Qwen3: answer with thinking on (default: off)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="cap on a target answer, tokens (default: 256)")
    g.add_argument("--gen-batch-size", type=int, default=64, help="prompts answered together (default: 64)")
    g.add_argument("--data-dir", help="where the answer caches go (default: the folder above --out; runs/toy for "
                                      "prompts the toy does not ship answers to)")
    g = ap.add_argument_group("drafter")
    g.add_argument("--drafter-init", help="causal LM with the target's tokenizer to start from (default: the target)")
    g.add_argument("--drafter-layers", help="keep N layers evenly spaced (first and last kept) or ids '0,5,29' "
                                            "(default: all; the first 2, '0,1', for the toy)")
    g.add_argument("--block-size", type=int, help="B, MASK tokens per block (default: 16; 8 for the toy)")
    g.add_argument("--num-anchors", type=int, help="K, blocks per training sequence (default: 64; 32 for the toy)")
    g.add_argument("--ar-weight", type=float, default=1.0, help="lambda, weight of the AR loss (default: 1.0)")
    g.add_argument("--decay-gamma", type=float, help="gamma, block position weights exp(-(i-1)/gamma) "
                                                     "(default: off, uniform)")
    g.add_argument("--first-token", choices=["causal", "mask"], default="causal", help="where d_1 is read: "
                   "'causal', the causal next-token head that lambda trains; 'mask', MASK 1 (default: causal)")
    g.add_argument("--random-init", action="store_true", help="same architecture as --drafter-init, random weights "
                   "(the paper's Fig. 2; default: its pretrained weights)")
    g = ap.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch and rank (default: 8)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default: 1)")
    g.add_argument("--lr", type=float, help="peak learning rate (default: 1e-3; 6e-3 for the tiny toy drafter)")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine to 10 %% (default: 20)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (default: 1.0)")
    g.add_argument("--freeze-embeddings", action="store_true", help="freeze embeddings and lm_head except the "
                                                                    "MASK row (default: train them)")
    g.add_argument("--max-len", type=int, default=1024, help="cut sequences to this many tokens (default: 1024)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="bfloat16 autocast (fp32 master weights) or float32 (default: auto = bfloat16 where the "
                        "device does it natively: CUDA, or a CPU with AVX512-BF16/AMX; else float32)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer's activations in "
                   "backward: less memory (SmolLM2, K 64, batch 2, 1,024 tokens: 3.2 -> 2.2 GiB), ~30 %% more compute")
    g.add_argument("--fsdp", action="store_true", help="shard fp32 weights, gradients and AdamW moments over the "
                   "processes (FSDP2, per decoder layer and root; bf16 by FSDP's mixed precision: layers gathered in "
                   "bf16, gradients reduced in fp32). Use it when 16 bytes a parameter do not fit one GPU (the "
                   "Qwen3-8B drafter: RESULTS.md, FSDP memory); else plain torchrun (DDP) is simpler and faster. "
                   "Rank 0 alone reads the drafter's weights (one host copy, not one a process) and broadcasts "
                   "them into the shards. "
                   "Checkpoints: OUT/checkpoint-fsdp, one file a process, resumed by any number of processes (with "
                   "another number the data order follows the new sharding). Without torchrun: FSDP on one process "
                   "(default: off)")
    # rank 0 works alone while the others wait in a collective: it reads the whole checkpoint before the first
    # broadcast, and at the end writes the gathered drafter. At 8B that is 16 GB read into 33 GB of fp32 and 16 GB
    # of bf16 written: minutes on a local disk, ~30 min at 10 MB/s on a slow network disk. NCCL's own default (10
    # min) would kill a healthy run there; 60 min still ends a hung one within the hour
    g.add_argument("--dist-timeout", type=float, default=60.0, metavar="MINUTES", help="how long a process waits "
                   "for the others in a collective before the run fails (torchrun and --fsdp; default: 60, for "
                   "rank 0 reading and writing an 8B drafter alone while the others wait)")
    g = ap.add_argument_group("evaluation and output")
    g.add_argument("--out", default="runs/toy/drafter", help="drafter folder (default: runs/toy/drafter)")
    g.add_argument("--eval-every", type=int, default=100, help="offline tau every N steps (default: 100)")
    g.add_argument("--val-anchors", type=int, default=32, help="blocks per held-out answer for tau (default: 32)")
    g.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default: 100)")
    g.add_argument("--no-resume", dest="resume", action="store_false", help="ignore out/checkpoint.pt")
    g.add_argument("--seed", type=int, default=0, help="data order and anchors (default: 0)")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 for the toy, whose tiny "
                   "models run fastest on one; use 1 on a CPU shared with other jobs)")
    g.add_argument("--device", help="cpu, cuda, ... (default: cuda if available; cuda:LOCAL_RANK under torchrun)")
    return ap.parse_args(argv)


def main(**overrides) -> dict:
    """Run the whole recipe. Keyword arguments are the command-line flags (snake_case); defaults as there."""
    defaults = vars(parse_args([]))
    if overrides.keys() - defaults.keys():
        raise TypeError(f"unknown arguments: {sorted(overrides.keys() - defaults.keys())}")
    args = argparse.Namespace(**{**defaults, **overrides})
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend, timeout = "nccl" if device.type == "cuda" else "gloo", datetime.timedelta(minutes=args.dist_timeout)
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout)
    elif args.fsdp:  # one process without torchrun: FSDP over a group of one (resumes a sharded checkpoint, too)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if args.target is None and args.dtype == "auto":
        args.dtype = "float32"  # the toy's tiny models: bf16 would buy nothing and round more
    bf16 = resolve_dtype(args.dtype, device) == torch.bfloat16
    torch.manual_seed(args.seed)
    if args.threads or args.target is None:
        torch.set_num_threads(args.threads or 1)

    val_prompts, layers = args.val_prompts, args.drafter_layers
    answers = val_answers = None
    if args.target is None:  # built-in toy: scaffolding from toy.py, not part of the method
        # one toy for every run, wherever --out puts the drafter: the same target and the same answers, checked
        # against toy.json
        paths = toy.open_toy(args.toy)
        if rank == 0:
            print(f"[toy] target and its answers from {paths['target']}; the drafter goes to {args.out}")
        answers = paths["train_answers"] if args.prompts is None else None
        val_answers = paths["test_answers"] if val_prompts is None else None
        args.target, args.prompts = paths["target"], args.prompts or paths["train"]
        args.data_dir = args.data_dir or TOY_RUNS
        # the target's first 2 layers, the plain prefix (LAB.md, exercise 5, compares other cuts)
        val_prompts, layers = val_prompts or paths["test"], layers or "0,1"
        args.block_size, args.num_anchors = args.block_size or 8, args.num_anchors or 32  # short toy answers
        args.lr = args.lr or 6e-3  # a 0.4M-parameter drafter takes a larger rate than the layers of a real LM
    if args.prompts is None:
        raise ValueError("--prompts is needed with --target")
    args.block_size, args.num_anchors, args.lr = args.block_size or 16, args.num_anchors or 64, args.lr or 1e-3
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    data_dir = args.data_dir or os.path.dirname(os.path.abspath(args.out))
    data = dict(tokenizer=tokenizer, prompt_field=args.prompt_field, thinking=args.thinking, cache_dir=data_dir,
                max_new_tokens=args.max_new_tokens, gen_batch_size=args.gen_batch_size, device=device,
                dtype=torch.bfloat16 if bf16 else None, rank=rank, world=world)
    train = load_data(args.target, prompts=args.prompts, num_prompts=args.num_prompts, answers=answers, **data)
    if val_prompts:
        val = load_data(args.target, prompts=val_prompts, num_prompts=args.num_val, answers=val_answers, **data)
    else:
        num_val = min(args.num_val, round(len(train) * args.val_fraction))
        train, val = train[: len(train) - num_val], train[len(train) - num_val:]

    target_vocab_size = AutoConfig.from_pretrained(args.target).get_text_config().vocab_size
    on_meta = args.fsdp and rank > 0  # FSDP: rank 0 alone reads the weights, the others get shards (shard_model)
    drafter = build_drafter(args.drafter_init or args.target, tokenizer, target_vocab_size=target_vocab_size,
                            layers=layers, block_size=args.block_size, num_anchors=args.num_anchors,
                            ar_weight=args.ar_weight, decay_gamma=args.decay_gamma, first_token=args.first_token,
                            random_init=args.random_init, meta=on_meta)
    if not on_meta:
        drafter.to(device)
    if args.gradient_checkpointing:
        drafter.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if rank == 0:
        params = sum(p.numel() for p in drafter.parameters())
        init = f"{args.drafter_init or args.target}{' (random weights)' if args.random_init else ''}"
        print(f"[drafter] {init}, layers {drafter.d3d_config.layer_ids or 'all'}, "
              f"{params / 1e6:.1f}M parameters; {len(train)} training and {len(val)} held-out answers")
        if args.ar_weight == 0 and args.first_token == "causal":
            print("[drafter] note: --ar-weight 0 trains no next-token head, yet d_1 comes from it (--first-token "
                  "causal); --first-token mask drafts d_1 from MASK 1, which the block loss does train")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result = train_drafter(drafter, train, val, out=args.out, steps=args.steps, batch_size=args.batch_size,
                           grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                           grad_clip=args.grad_clip, freeze=args.freeze_embeddings, pad_id=pad_id,
                           max_len=args.max_len, num_anchors=args.num_anchors, block_size=args.block_size,
                           ar_weight=args.ar_weight, decay_gamma=args.decay_gamma, eval_every=args.eval_every,
                           val_anchors=args.val_anchors, save_every=args.save_every, seed=args.seed, bf16=bf16,
                           resume=args.resume, rank=rank, world=world, fsdp=args.fsdp, device=device)

    peak = peak_memory_gib(device)
    # the same held-out blocks with d_1 drafted by MASK 1 instead of the causal next-token head, or the reverse
    other = "mask" if drafter.d3d_config.first_token == "causal" else "causal"
    evaluation = dict(block_size=args.block_size, num_anchors=args.val_anchors, pad_id=pad_id, max_len=args.max_len,
                      first_token=other)
    sharded = result.pop("sharded", None)
    if sharded is not None:  # every rank evaluates the sharded drafter, then all gather it once, onto rank 0's host
        result[f"offline_tau_first_token_{other}"] = evaluate_tau(drafter, val, sharded=sharded, **evaluation)
        drafter = gather_drafter(sharded, drafter) or drafter  # ranks > 0 keep their shards
    if bf16 and (rank == 0 or sharded is None):  # the final drafter in the dtype it was trained in (the fp32 master
        drafter.model.to(torch.bfloat16)  # weights stay in the checkpoint)
    if rank == 0:
        if sharded is None:
            autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
            result[f"offline_tau_first_token_{other}"] = evaluate_tau(drafter, val, autocast=autocast, **evaluation)
        drafter.save_pretrained(args.out, tokenizer=tokenizer)
        target = os.path.abspath(args.target) if os.path.exists(args.target) else args.target
        record = {**vars(args), "target": target, "val_prompts": val_prompts, "answers": answers,
                  "val_answers": val_answers, "layer_ids": drafter.d3d_config.layer_ids,
                  **result,
                  "peak_memory_gib": round(peak, 2), "device": str(device), "world_size": world,
                  "compute_dtype": "bfloat16" if bf16 else "float32", "fsdp": args.fsdp}
        with open(os.path.join(args.out, "train_args.json"), "w") as f:
            json.dump(record, f, indent=2)
        print(f"[done] offline tau (B={args.block_size}) on {len(val)} held-out answers: {result['offline_tau']:.3f} "
              f"(d_1 from {'the causal next-token head' if other == 'mask' else 'MASK 1'}; "
              f"{result[f'offline_tau_first_token_{other}']:.3f} from {'MASK 1' if other == 'mask' else 'the head'}); "
              f"training {result['train_seconds']:.0f} s; peak memory {peak:.2f} GiB "
              f"({'GPU allocated' if device.type == 'cuda' else 'RSS'})")
        kept = f"{SHARDED_CHECKPOINT}/ resumes" if args.fsdp else "checkpoint.pt and optimizer-*.pt resume"
        print(f"[done] target: {target}\n[done] answer caches: {data_dir}\n[done] drafter (+ train_args.json; "
              f"{kept} or extend the run): {os.path.abspath(args.out)}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {**result, "drafter": drafter, "out": args.out}


# ----------------------------------------------------------------------------------------------------------------------
# Pruning: python train.py prune --drafter FOLDER ... (paper Fig. 1b; d3d.prune_drafter)


def parse_prune_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train.py prune", description="Progressive layer pruning of a trained drafter "
                                 "with recovery distillation (paper Fig. 1b), on the answers it was trained with.")
    g = ap.add_argument_group("input and output")
    g.add_argument("--drafter", default="runs/toy/drafter", help="trained drafter folder (default: runs/toy/drafter)")
    g.add_argument("--out", help="pruned drafter folder (default: DRAFTER-pruned); prune_table.json goes in it")
    g = ap.add_argument_group("stopping rule (one at least)")
    g.add_argument("--min-layers", type=int, help="stop at this many layers")
    g.add_argument("--tau-floor", type=float, help="stop before tau falls below this fraction of the unpruned tau")
    g = ap.add_argument_group("recovery and evaluation")
    g.add_argument("--recovery-steps", type=int, default=50, help="distillation steps after each removal; 0 = no "
                                                                  "recovery (default: 50)")
    g.add_argument("--lr", type=float, default=1e-4, help="recovery learning rate (default: 1e-4)")
    g.add_argument("--beta", type=float, default=0.5, help="teacher adjusted toward the label by beta (default: 0.5)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: 8)")
    g.add_argument("--num-val", type=int, default=64, help="held-out answers for validation tau (default: 64)")
    g.add_argument("--val-anchors", type=int, default=16, help="blocks per held-out answer (default: 16)")
    g.add_argument("--compare-prompts", type=int, default=8, help="held-out prompts decoded with the unpruned and "
                   "the pruned drafter against the target, for the speedup (default: 8; 0 = skip)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens per compared answer (default: 128)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 autocast for scoring and recovery (fp32 master weights), or float32 (default: auto "
                        "on CUDA = bfloat16 where native; float32 on a CPU)")
    g.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, help="recompute each layer's "
                   "activations in the backward of recovery steps: less memory, ~30 %% more compute (default: on "
                   "with CUDA, off on a CPU)")
    g.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0, help="anchors and batch order (default: 0)")
    return ap.parse_args(argv)


def load_trained(drafter: str, device):
    """A trained drafter folder with what it was trained on: (recipe, tokenizer, drafter, train, val, pad_id); the
    answers come from the caches train.py wrote (train_args.json names them)."""
    path = os.path.join(drafter, "train_args.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: give a drafter folder written by train.py")
    with open(path) as f:
        recipe = json.load(f)  # how the drafter was trained: its target, prompts and answer caches
    tokenizer = AutoTokenizer.from_pretrained(drafter)
    model = d3d.Drafter.from_pretrained(drafter, dtype=torch.float32, device=device)
    data = dict(tokenizer=tokenizer, prompt_field=recipe["prompt_field"], thinking=recipe["thinking"],
                cache_dir=recipe.get("data_dir") or os.path.dirname(os.path.abspath(drafter)),
                max_new_tokens=recipe["max_new_tokens"], gen_batch_size=recipe["gen_batch_size"], device=device)
    train = load_data(recipe["target"], prompts=recipe["prompts"], num_prompts=recipe["num_prompts"],
                      answers=recipe.get("answers"), **data)
    if recipe.get("val_prompts"):
        val = load_data(recipe["target"], prompts=recipe["val_prompts"], num_prompts=recipe["num_val"],
                        answers=recipe.get("val_answers"), **data)
    else:
        num_held = min(recipe["num_val"], round(len(train) * recipe["val_fraction"]))
        train, val = train[: len(train) - num_held], train[len(train) - num_held:]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return recipe, tokenizer, model, train, val, pad_id


def eval_main(argv=None) -> dict:
    """python train.py eval --drafter FOLDER: offline tau on the held-out answers the drafter was trained with,
    with d_1 drafted by the causal next-token head ("causal") and by MASK 1 ("mask")."""
    ap = argparse.ArgumentParser(prog="train.py eval", description=eval_main.__doc__.split(":", 1)[1].strip())
    ap.add_argument("--drafter", default="runs/toy/drafter", help="trained drafter folder (default: runs/toy/drafter)")
    ap.add_argument("--num-val", type=int, help="held-out answers (default: as in training)")
    ap.add_argument("--val-anchors", type=int, help="blocks per held-out answer (default: as in training)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"],
                    help="bfloat16 autocast or float32 (default: as in training; auto: bfloat16 where native)")
    ap.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recipe, _, drafter, _, val, pad_id = load_trained(args.drafter, device)
    val = val[: args.num_val or recipe["num_val"]]
    dtype = args.dtype or recipe.get("compute_dtype") or recipe.get("dtype")
    bf16 = resolve_dtype(dtype, device) == torch.bfloat16
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    block_size = drafter.d3d_config.block_size
    taus = {first: evaluate_tau(drafter, val, block_size=block_size, pad_id=pad_id, max_len=recipe["max_len"],
                                num_anchors=args.val_anchors or recipe["val_anchors"], autocast=autocast,
                                first_token=first, per_block=True) for first in ("causal", "mask")}
    result = {first: t.mean().item() for first, t in taus.items()}
    curves = {first: acceptance_curve(t, block_size) for first, t in taus.items()}
    print(f"[eval] {args.drafter}: offline tau (B={block_size}) on {len(val)} held-out answers "
          f"({len(taus['causal'])} blocks): {result['causal']:.3f} with d_1 from the causal next-token head, "
          f"{result['mask']:.3f} from MASK 1 (this drafter uses {drafter.d3d_config.first_token!r})")
    print("[eval] share of blocks with d_1 .. d_i all accepted, and d_i accepted given d_1 .. d_(i-1) were:")
    print(f"{'i':>4}{'head: all':>11}{'given':>7}{'MASK 1: all':>13}{'given':>7}")
    for i in range(block_size):
        row = "".join(f"{curves[f][i]:{w}.3f}{curves[f][i] / max(curves[f][i - 1] if i else 1.0, 1e-9):7.2f}"
                      for f, w in (("causal", 11), ("mask", 13)))
        print(f"{i + 1:>4}{row}")
    return {**result, "curve": curves}


@torch.no_grad()
def compare_drafters(target, drafters: dict, prompts, *, max_new_tokens: int, eos) -> dict:
    """Decode the same prompts with each drafter (sync and async) and with the target alone, in one run: tau and
    speedup (target-only time per token / speculative time per token, prefill excluded) per drafter and mode."""
    times = collections.defaultdict(float)
    tokens, taus = collections.defaultdict(int), collections.defaultdict(list)
    runs = [("target", None, "target")] + [(f"{name} {mode}", d, mode) for name, d in drafters.items()
                                           for mode in ("sync", "async")]
    d3d.generate(target, None, prompts[0], max_new_tokens=4, mode="target")  # warm-up
    for ids in tqdm(prompts, desc="decode with each drafter", leave=False):
        for label, drafter, mode in runs:
            _, stats = d3d.generate(target, drafter, ids, max_new_tokens=max_new_tokens, mode=mode, eos_token_id=eos)
            times[label] += stats["time_total"] - stats["time_prefill"]
            tokens[label] += stats["num_new_tokens"] - 1
            taus[label].append(stats["tau"])
    base = times["target"] / max(tokens["target"], 1)
    return {label: {"speedup": base / (times[label] / max(tokens[label], 1)),
                    "tau": sum(taus[label]) / len(taus[label])} for label, _, _ in runs[1:]}


def prune_memory_estimate(num_params: int, hidden: int, layers: int, batch: int, seq_len: int, vocab: int,
                          checkpointing: bool, device_type: str) -> dict[str, float]:
    """GiB at the peak of a recovery step of `prune`, per part and "total". seq_len: tokens of one packed sequence
    (answer + K x B MASKs). The drafter is fp32 (weights, gradients, two AdamW moments) and so is its teacher copy;
    the snapshot that --tau-floor undoes to stays on the CPU and is not counted. Activations: ~26 x hidden values
    per token and layer saved for backward (norm inputs and outputs, q/k/v before and after RoPE, attention input
    and output, the gated MLP's four intermediate-size tensors), bf16 under CUDA's autocast and fp32 on a CPU; with
    checkpointing, each layer's fp32 input plus one layer recomputed. The loss keeps ~4 chunks of fp32 logits
    (student, log-probs, their gradient, adjusted teacher) of loss_chunk_rows rows. Attention scores are not
    counted: SDPA does not store them. A rough guide, not a bound."""
    tokens, act_bytes = batch * seq_len, 2 if device_type == "cuda" else 4
    layer_activations = tokens * hidden * 26 * act_bytes
    if checkpointing:
        activations = layers * tokens * hidden * 4 + layer_activations
    else:
        activations = layers * layer_activations
    parts = {"weights": 4 * num_params, "gradients": 4 * num_params, "adamw_moments": 8 * num_params,
             "teacher": 4 * num_params, "activations": activations,
             "logits": 4 * runtime.loss_chunk_rows(vocab, device_type) * vocab * 4}
    gib = {name: size / 2**30 for name, size in parts.items()}
    return {**gib, "total": sum(gib.values())}


def fsdp_memory_estimate(num_params: float, root_params: float, layer_params: float, hidden: int, layers: int,
                         batch: int, seq_len: int, vocab: int, world: int, checkpointing: bool = True) -> dict:
    """GiB per GPU at the peak of a `train.py --fsdp` step on CUDA in bf16, per part and "total", on `world` GPUs.
    Sharded (/world): fp32 weights (4 bytes a parameter), fp32 gradients (4), AdamW's two fp32 moments (8).
    Gathered whole, in bf16: the root (embeddings and head, `root_params`), gathered for the whole forward and
    backward, and two layers (the one computing and the next, prefetched). Gradients whole before their
    reduce-scatter: the root's in bf16 plus its fp32 copy for the reduction (a layer's, far smaller, is left out).
    Activations and logits as in prune_memory_estimate, bf16, except that each checkpointed layer input is bf16 too
    (FSDP's mixed precision keeps the residual stream in bf16). seq_len: tokens of one packed sequence (answer +
    K x B MASKs). A rough guide, not a bound: fragmentation, the CUDA context and NCCL buffers come on top."""
    tokens = batch * seq_len
    layer_activations = tokens * hidden * 26 * 2
    activations = layers * tokens * hidden * 2 + layer_activations if checkpointing else layers * layer_activations
    parts = {"weights": 4 * num_params / world, "gradients": 4 * num_params / world,
             "adamw_moments": 8 * num_params / world, "gathered_weights": 2 * (root_params + 2 * layer_params),
             "gathered_gradients": (2 + 4) * root_params, "activations": activations,
             "logits": 4 * runtime.loss_chunk_rows(vocab, "cuda") * vocab * 4}
    gib = {name: size / 2**30 for name, size in parts.items()}
    return {**gib, "total": sum(gib.values())}


def prune_main(*, drafter, out, min_layers, tau_floor, recovery_steps, lr, beta, batch_size, num_val, val_anchors,
               compare_prompts, max_new_tokens, dtype=None, gradient_checkpointing=None, device, seed) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = out or drafter.rstrip("/") + "-pruned"
    if dtype is None:  # a GPU prunes in bf16 autocast like training; a CPU keeps exact fp32 (bf16 is slow on most)
        dtype = "auto" if device.type == "cuda" else "float32"
    checkpointing = device.type == "cuda" if gradient_checkpointing is None else gradient_checkpointing
    recipe, tokenizer, model, train, val, pad_id = load_trained(drafter, device)
    max_len = recipe["max_len"]
    val_batches = [tuple(t.to(device) for t in collate(val[s: s + batch_size], pad_id, max_len))
                   for s in range(0, min(num_val, len(val)), batch_size)]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    train_batches = [tuple(t.to(device) for t in collate([train[i] for i in order[s: s + batch_size]], pad_id, max_len))
                     for s in range(0, len(order) - batch_size + 1, batch_size)]
    # the unpruned drafter for the final comparison waits in host memory: on the device it would sit beside the
    # teacher copy prune_drafter makes
    unpruned = runtime.host_copy(model) if compare_prompts else None
    print(f"[prune] {drafter}: {model.model.config.num_hidden_layers} layers; {len(val_batches)} validation and "
          f"{len(train_batches)} recovery batches of {batch_size}")
    bf16 = resolve_dtype(dtype, device) == torch.bfloat16
    config = model.model.config.get_text_config()
    seq_len = max((ids.shape[1] for ids, _ in train_batches), default=0) + val_anchors * model.d3d_config.block_size
    estimate = prune_memory_estimate(sum(p.numel() for p in model.parameters()), config.hidden_size,
                                     max(config.num_hidden_layers - 1, 1),  # recovery follows the first removal
                                     batch_size, seq_len, model.d3d_config.target_vocab_size, checkpointing,
                                     device.type)
    print(f"[prune] estimated peak of a recovery step: {estimate['total']:.1f} GiB = " + ", ".join(
        f"{name} {gib:.1f}" for name, gib in estimate.items() if name != "total") +
        f" (activation checkpointing {'on' if checkpointing else 'off'}; the snapshot --tau-floor undoes to is "
        "kept on the CPU, not counted)")
    # no cast cache: each use of a weight (the head, on the blocks and on the causal stream) casts anew, so its recovery
    # gradient sums in fp32, not in one cached bf16 copy
    with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if bf16 else contextlib.nullcontext():
        table = d3d.prune_drafter(model, val_batches, train_batches, min_layers=min_layers, tau_floor=tau_floor,
                                  recovery_steps=recovery_steps, lr=lr, beta=beta, num_anchors=val_anchors, seed=seed,
                                  checkpointing=checkpointing, score=fast.tau_without_each_layer,
                                  log=lambda msg: tqdm.write(f"[prune] {msg}"))
    result = {"table": table, "drafter": os.path.abspath(drafter), "recovery_steps": recovery_steps, "beta": beta,
              "lr": lr, "dtype": "bfloat16" if bf16 else "float32", "num_val": min(num_val, len(val)),
              "val_anchors": val_anchors, "layer_ids": model.d3d_config.layer_ids, "checkpointing": checkpointing,
              "peak_memory_estimate_gib": round(estimate["total"], 2),
              "peak_memory_gib": round(peak_memory_gib(device), 2)}
    if compare_prompts:
        target = runtime.load_causal_lm(recipe["target"], torch.float32, device).eval()
        prompts = [torch.tensor([p], device=device) for p, _ in val[:compare_prompts]]
        eos = getattr(target.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        drafters = {"unpruned": unpruned.to(device).eval(), "pruned": model.eval()}
        result["decode"] = compare_drafters(target, drafters, prompts, max_new_tokens=max_new_tokens, eos=eos)
    model.save_pretrained(out, tokenizer=tokenizer)
    with open(os.path.join(out, "train_args.json"), "w") as f:
        json.dump({**recipe, "pruned_from": os.path.abspath(drafter), "layer_ids": model.d3d_config.layer_ids}, f,
                  indent=2)
    with open(os.path.join(out, "prune_table.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{'removed':>8}{'layers':>8}{'tau before':>12}{'tau after':>11}{'% of tau0':>11}{'scoring s':>11}"
          f"{'total s':>9}  (tau: offline, B={model.d3d_config.block_size}, {result['num_val']} held-out answers x "
          f"{val_anchors} blocks, after recovery of {recovery_steps} steps)")
    tau0 = table[0]["tau_after_recovery"]
    for row in table:
        removed = "-" if row["removed_layer"] is None else row["removed_layer"]
        print(f"{removed:>8}{row['layers']:>8}{row['tau_before_recovery']:>12.3f}{row['tau_after_recovery']:>11.3f}"
              f"{100 * row['tau_after_recovery'] / tau0:>10.1f}%{row['score_seconds']:>11.0f}"
              f"{row['seconds']:>9.0f}" + ("  (undone: below the floor)" if not row["kept"] else ""))
    for label, r in result.get("decode", {}).items():
        print(f"[decode] {label:<16} speedup {r['speedup']:.2f}x over target-only, tau {r['tau']:.2f}")
    print(f"[done] peak memory {result['peak_memory_gib']:.2f} GiB "
          f"({'GPU allocated' if device.type == 'cuda' else 'RSS'}; estimated {estimate['total']:.2f})")
    print(f"[done] pruned drafter ({model.model.config.num_hidden_layers} layers, original ids "
          f"{model.d3d_config.layer_ids}): {os.path.abspath(out)}; table: {os.path.join(out, 'prune_table.json')}")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["prune"]:  # python train.py prune --drafter FOLDER ...
        prune_main(**vars(parse_prune_args(sys.argv[2:])))
    elif sys.argv[1:2] == ["eval"]:  # python train.py eval --drafter FOLDER
        eval_main(sys.argv[2:])
    else:
        main(**vars(parse_args()))
