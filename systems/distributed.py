"""Training on several processes, and the checkpoints a training run resumes from.

The process group (torchrun, or a group of one for FSDP on one process); FSDP2: sharding the
drafter per decoder layer and root, rank 0's weights broadcast into every rank's shards,
frozen embedding rows on a sharded embedding, the sharded drafter gathered back into one;
checkpoints written in pieces by one process (checkpoint.pt and one file per AdamW moment),
or by every process together under FSDP (a torch.distributed.checkpoint folder). DDP itself
is PyTorch's DistributedDataParallel, wrapped around the training loss in train.py.
"""

from __future__ import annotations

import collections
import copy
import datetime
import os
import random
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from transformers import AutoModelForCausalLM

import d3d
import runtime

# the checkpoint's names in train.py's --out, by which cli.py knows a run: checkpoint.pt (with
# one file per AdamW moment), or under --fsdp a torch.distributed.checkpoint folder, one file
# per process
from systems.cli import CHECKPOINT, SHARDED_CHECKPOINT  # noqa: F401

# ---------------------------------------------------------------------------------------------
# Process group


def start_process_group(
    device: torch.device, fsdp: bool, timeout_minutes: float
) -> tuple[torch.device, int, int]:
    """The process group of a run, if it needs one: under torchrun (WORLD_SIZE > 1) all its
    processes, each on its own GPU (cuda:LOCAL_RANK) on CUDA; with `fsdp` and one process, a
    group of one. NCCL on CUDA, else gloo; a process waits `timeout_minutes` for the others
    in a collective before the run fails. Returns (device, rank, world)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout)
    elif fsdp:
        # one process without torchrun: FSDP over a group of one (resumes a sharded checkpoint, too)
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return device, rank, world


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any process (an all-reduce of one number: every process calls
    it at the same point, and all get the same answer)."""
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def end_process_group() -> None:
    """Every process waits for the others, then the process group (if any) is taken down."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# FSDP2: sharding, broadcasting from rank 0, gathering back


def shard_model(model: torch.nn.Module, decoder_layers, bf16: bool, device: torch.device) -> None:
    """FSDP2 (fully_shard) on each decoder layer, then on the root (embeddings, final norm,
    head): each process keeps 1/N of the fp32 weights, gradients and AdamW moments, and a
    layer is all-gathered only for its forward and backward. bf16 by FSDP2's
    MixedPrecisionPolicy rather than autocast: the all-gather moves and holds bf16 copies
    (half the traffic and the memory of an unsharded layer) and each matmul reads them as
    they are, where autocast would gather fp32 and cast at every op; gradients are reduced
    in fp32 into the fp32 master shards. On several processes only rank 0 holds the weights
    (ranks > 0 built the model on the meta device: one host copy, not one a process); they
    reach every rank's shards on `device` by broadcast_from_rank0."""
    policy = MixedPrecisionPolicy()
    if bf16:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    several = dist.get_world_size() > 1
    # references to the weights, no copy
    full = model.state_dict() if several and dist.get_rank() == 0 else {}
    for layer in decoder_layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if several:
        broadcast_from_rank0(model, full, device)


def non_persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict leaves out (rotary frequencies), by name."""
    return [
        (name, buffer)
        for name, buffer in module.named_buffers()
        if name.rpartition(".")[2]
        in module.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
    ]


def broadcast_from_rank0(model: torch.nn.Module, full: dict, device: torch.device) -> None:
    """Rank 0's whole state dict `full` into every rank's shards of the sharded `model`, one
    tensor at a time (so no rank but 0 ever holds more than one whole tensor); ranks > 0
    first allocate their shards (empty) on `device` in place of the meta tensors. The
    buffers outside the state dict follow whole from rank 0: to_empty leaves them
    uninitialised on ranks > 0."""
    if dist.get_rank() > 0:
        model.to_empty(device=device)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for _, buffer in non_persistent_buffers(model):
        dist.broadcast(buffer, src=0)


def freeze_sharded_rows(weight: torch.nn.Parameter, keep: torch.Tensor) -> None:
    """freeze_embeddings' (train.py) row mask on a sharded (FSDP2, DTensor) embedding,
    registered after fully_shard on the sharded parameter: FSDP2 runs its
    post-accumulate-grad hooks itself once the reduced gradient shard is in .grad (a plain
    tensor hook on it never fires: autograd only sees the gathered copy). The mask is cut
    the way the weight is (torch.chunk of dim 0: rank r holds rows r*ceil(V/N) on), so each
    rank zeroes its own frozen rows; AdamW then moves them not at all (zero moments, no
    weight decay in their group), as with the hook."""
    local = distribute_tensor(
        keep, weight.device_mesh, weight.placements, src_data_rank=None
    ).to_local()
    if local.shape[0] != weight.to_local().shape[0]:
        raise RuntimeError(
            f"frozen-row mask has {local.shape[0]} rows, the local shard "
            f"{weight.to_local().shape[0]}: FSDP sharded the embedding another way"
        )
    weight.register_post_accumulate_grad_hook(
        lambda param: param.grad.to_local().mul_(local.to(param.grad.dtype))
    )


def gather_drafter(model: torch.nn.Module, drafter: d3d.Drafter) -> d3d.Drafter | None:
    """The sharded drafter gathered once into host memory (every process takes part): an
    ordinary d3d.Drafter on rank 0, None elsewhere. Built on the meta device and filled with
    the gathered weights, so the host holds one copy; the buffers not in the state dict
    (rotary frequencies) are copied from the sharded model, which keeps them whole."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
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


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(out: str, step: int, training_state: dict, optimizer_state: dict) -> None:
    """A resumable checkpoint in pieces, each written beside its old version and renamed
    over it (a reader never sees half a file): checkpoint.pt (fp32 weights, step, schedule,
    RNG, AdamW's step counts and settings), then one optimizer-KEY.pt per AdamW moment
    (exp_avg, exp_avg_sq), each the size of the weights. Only one piece is doubled at a
    time, so a save needs the spare disk of one piece, never of a second checkpoint (a
    ~2B-parameter drafter: 3 x 8 GB on disk, 32 GB at the peak of a save instead of 48). A
    kill between two renames leaves some moments one save behind the weights; the resume
    says so and goes on with them. Plain types only (tensors, numbers, strings, containers
    of them): load_checkpoint reads with weights_only=True, which unpickles no other class."""
    os.makedirs(out, exist_ok=True)
    moments = collections.defaultdict(dict)  # key -> {parameter index: tensor}
    for index, per_param in optimizer_state["state"].items():
        for key, value in per_param.items():
            moments[key][index] = value
    steps = moments.pop("step", {})  # small: kept with the weights
    pieces = {
        CHECKPOINT: {
            **training_state,
            "param_groups": optimizer_state["param_groups"],
            "adam_steps": steps,
            "moment_keys": sorted(moments),
        }
    }
    pieces.update({f"optimizer-{key}.pt": value for key, value in moments.items()})
    for name, piece in pieces.items():
        path = os.path.join(out, name)
        torch.save({"step": step, "piece": piece}, path + ".tmp")
        os.replace(path + ".tmp", path)


def load_checkpoint(out: str) -> tuple[dict, dict | None]:
    """(training state, AdamW state dict or None) from save_checkpoint's pieces; ({}, None)
    if there are none, and a refusal if `out` holds an --fsdp checkpoint instead. Read into
    host memory: the model's and the optimizer's load_state_dict copy each tensor to its
    parameter's device, and AdamW's step counts stay on the CPU, where its (not capturable)
    update reads them."""
    path = os.path.join(out, CHECKPOINT)
    if not os.path.exists(path):
        if os.path.isdir(os.path.join(out, SHARDED_CHECKPOINT)):
            raise runtime.UserError(
                f"{out} holds a checkpoint of an --fsdp run ({SHARDED_CHECKPOINT}): resume "
                "it with --fsdp (any number of processes), or start afresh with --no-resume"
            )
        return {}, None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if "piece" not in saved:
        raise runtime.UserError(
            f"{path} is not a checkpoint of this train.py: move it away or rerun with --no-resume"
        )
    state = {**saved["piece"], "step": saved["step"]}
    moments = {}
    for key in state["moment_keys"]:
        piece_path = os.path.join(out, f"optimizer-{key}.pt")
        if not os.path.exists(piece_path):
            print(f"[train] {piece_path} is missing: resuming with fresh AdamW moments")
            return state, None
        piece = torch.load(piece_path, map_location="cpu", weights_only=True)
        if piece["step"] != state["step"]:
            print(
                f"[train] AdamW {key} is from step {piece['step']}, the weights from step "
                f"{state['step']} (a save was cut short): resuming with it"
            )
        moments[key] = piece["piece"]
    per_param = {
        index: {"step": count, **{key: moments[key][index] for key in moments}}
        for index, count in state["adam_steps"].items()
    }
    return state, {"state": per_param, "param_groups": state["param_groups"]}


def save_sharded_checkpoint(
    out: str, step: int, model: torch.nn.Module, optimizer, training_state: dict
) -> None:
    """--fsdp's checkpoint, by every process together: torch.distributed.checkpoint (DCP)
    writes the weights and AdamW state, each process its own shards, into
    out/checkpoint-fsdp.tmp, with train_state.pt (step, schedule, skipped steps, every
    rank's RNG, world size); once all is written, rank 0 renames the folder over the last
    one (the disk of two checkpoints at the peak of a save, unlike the piecewise
    checkpoint.pt). DCP stores each tensor with its global shape, so any number of processes
    can load it. train_state.pt holds plain types only, as save_checkpoint's pieces."""
    rank = dist.get_rank()
    world = dist.get_world_size()
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
        torch.save(
            {**training_state, "step": step, "world": world, "rngs": rngs},
            os.path.join(path + ".tmp", "train_state.pt"),
        )
        # a kill between the two renames leaves .old whole: load_sharded_checkpoint reads it
        if os.path.exists(path):
            shutil.rmtree(path + ".old", ignore_errors=True)
            os.replace(path, path + ".old")
        os.replace(path + ".tmp", path)
        shutil.rmtree(path + ".old", ignore_errors=True)
    dist.barrier()


def load_sharded_checkpoint(out: str, model: torch.nn.Module, optimizer, check=None) -> dict:
    """Load save_sharded_checkpoint's folder into the sharded model and optimizer, by every
    process together; the training state ({} if there is no checkpoint); `check(state)` may
    refuse it first. With the world size it was saved with, each rank takes back its own
    RNG; with another, rank 0's (the data order then follows the new sharding of the data,
    train[rank::world])."""
    path = os.path.join(out, SHARDED_CHECKPOINT)
    if not os.path.exists(os.path.join(path, "train_state.pt")) and os.path.exists(path + ".old"):
        path += ".old"
    if not os.path.exists(os.path.join(path, "train_state.pt")):
        if os.path.exists(os.path.join(out, CHECKPOINT)):
            raise runtime.UserError(
                f"{out} holds a checkpoint of a run without --fsdp (checkpoint.pt): resume it "
                "without --fsdp, or start afresh with --no-resume"
            )
        return {}
    state = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=True)
    if check is not None:  # the recipe, before any tensor of another shape is read
        check(state)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"]
    )
    # each rank its own random states; with another number of processes, rank 0's for all
    saved_by = 0
    if dist.get_world_size() == state["world"]:
        saved_by = dist.get_rank()
    torch_rng, python_rng = state["rngs"][saved_by]
    return {**state, "rng": torch_rng, "python_rng": python_rng, "path": path}
