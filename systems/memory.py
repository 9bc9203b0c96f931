"""Memory of training and pruning: the peak a run measured, whether training's longest sequence
fits before the first step, and what a step is estimated to hold at its peak."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import runtime

try:
    import resource  # peak RSS on Linux and macOS; Windows has no such module
except ImportError:
    resource = None


def peak_memory_gib(device, reset: bool = False) -> float:
    """Peak memory so far: CUDA, allocated by PyTorch (since the last reset); CPU, the
    process's peak RSS."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    if resource is None:
        return float("nan")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def check_training_size(drafter, train, val, s) -> None:
    """runtime.check_training_size before train.py's first step (`s`: its TrainSettings): the
    positions and the bytes of the longest packed sequence, cut at --max-len, one line if they
    do not fit. Under FSDP the positions alone: the bytes it counts are those of a whole
    drafter on one device."""
    if s.fsdp:
        longest = max(len(prompt) + len(response) for prompt, response in train + val)
        max_len = min(s.max_len, longest)
        block_size = drafter.d3d_config.block_size
        asked = f"training with --max-len {max_len} and --block-size {block_size}"
        lower = "--block-size or --max-len"
        runtime.check_positions(asked, max_len + block_size, "the drafter", drafter, lower)
        return
    runtime.check_training_size(
        drafter,
        train + val,
        batch_size=s.batch_size,
        max_len=s.max_len,
        device=s.device,
        bf16=s.bf16,
        val_anchors=s.val_anchors,
    )


@dataclass
class StepShapes:
    """The sizes the memory of a drafter's training step follows (prune_memory_estimate,
    fsdp_memory_estimate): the drafter's and the batch's."""

    # the drafter's parameters
    num_params: float
    # its hidden size and its number of decoder layers
    hidden: int
    layers: int
    # packed sequences a step, and the tokens of one (answer + K x B MASKs)
    batch: int
    seq_len: int
    # the target's vocabulary: the width of the logits
    vocab: int
    # activation checkpointing: each layer's input kept, the layer recomputed in backward
    checkpointing: bool = True

    def activations(self, act_bytes: int, input_bytes: int) -> float:
        """Bytes of the activations saved for backward: ~26 x hidden values per token and
        layer, `act_bytes` each; with checkpointing, each layer's input (`input_bytes` a value)
        plus one layer recomputed."""
        tokens = self.batch * self.seq_len
        layer_activations = tokens * self.hidden * 26 * act_bytes
        if self.checkpointing:
            return self.layers * tokens * self.hidden * input_bytes + layer_activations
        return self.layers * layer_activations


def prune_memory_estimate(shapes: StepShapes, device_type: str) -> dict[str, float]:
    """GiB at the peak of a recovery step of `prune`, per part and "total". seq_len: tokens
    of one packed sequence (answer + K x B MASKs). The drafter is fp32 (weights, gradients,
    two AdamW moments) and so is its teacher copy; the snapshot that --tau-floor undoes to
    stays on the CPU and is not counted. Activations: ~26 x hidden values per token and
    layer saved for backward (norm inputs and outputs, q/k/v before and after RoPE,
    attention input and output, the gated MLP's four intermediate-size tensors), bf16 under
    CUDA's autocast and fp32 on a CPU; with checkpointing, each layer's fp32 input plus one
    layer recomputed. The loss keeps ~4 chunks of fp32 logits (student, log-probs, their
    gradient, adjusted teacher) of loss_chunk_rows rows. Attention scores are not counted:
    SDPA does not store them. A rough guide, not a bound."""
    act_bytes = 4  # bytes a saved activation: fp32 on a CPU
    if device_type == "cuda":
        act_bytes = 2  # bf16 under autocast
    parts = {
        "weights": 4 * shapes.num_params,
        "gradients": 4 * shapes.num_params,
        "adamw_moments": 8 * shapes.num_params,
        "teacher": 4 * shapes.num_params,
        "activations": shapes.activations(act_bytes, input_bytes=4),
        "logits": 4 * runtime.loss_chunk_rows(shapes.vocab, device_type) * shapes.vocab * 4,
    }
    gib = {name: size / 2**30 for name, size in parts.items()}
    return {**gib, "total": sum(gib.values())}


def fsdp_memory_estimate(
    shapes: StepShapes, root_params: float, layer_params: float, world: int
) -> dict:
    """GiB per GPU at the peak of a `train.py --fsdp` step on CUDA in bf16, per part and
    "total", on `world` GPUs. Sharded (/world): fp32 weights (4 bytes a parameter), fp32
    gradients (4), AdamW's two fp32 moments (8). Gathered whole, in bf16: the root
    (embeddings and head, `root_params`), gathered for the whole forward and backward, and
    two layers (the one computing and the next, prefetched). Gradients whole before their
    reduce-scatter: the root's in bf16 plus its fp32 copy for the reduction (a layer's, far
    smaller, is left out). Activations and logits as in prune_memory_estimate, bf16, except
    that each checkpointed layer input is bf16 too (FSDP's mixed precision keeps the
    residual stream in bf16). seq_len: tokens of one packed sequence (answer + K x B MASKs).
    A rough guide, not a bound: fragmentation, the CUDA context and NCCL buffers come on
    top."""
    parts = {
        "weights": 4 * shapes.num_params / world,
        "gradients": 4 * shapes.num_params / world,
        "adamw_moments": 8 * shapes.num_params / world,
        "gathered_weights": 2 * (root_params + 2 * layer_params),
        "gathered_gradients": (2 + 4) * root_params,
        "activations": shapes.activations(act_bytes=2, input_bytes=2),
        "logits": 4 * runtime.loss_chunk_rows(shapes.vocab, "cuda") * shapes.vocab * 4,
    }
    gib = {name: size / 2**30 for name, size in parts.items()}
    return {**gib, "total": sum(gib.values())}
