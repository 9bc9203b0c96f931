"""The drafter train.py starts from: a pretrained causal LM with the target's tokenizer, some of
its layers kept (select_layers), made a D3D drafter by d3d.make_drafter (build_drafter); and its
embeddings frozen but for the MASK row (freeze_embeddings)."""

from __future__ import annotations

import functools
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import d3d
import runtime


def select_layers(num_layers: int, spec) -> list[int] | None:
    """`spec`: None (all), a count N (evenly spaced over the depth, first and last
    kept) or explicit ids "0,14,29"."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str) and "," in spec:
        spec = spec.split(",")
    if isinstance(spec, (list, tuple)):
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
        init_tokenizer = runtime.load_tokenizer(drafter_init, "--drafter-init")
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
        model = runtime.load_causal_lm(drafter_init, torch.float32, flag="--drafter-init")
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
    config = runtime.from_local_or_hub(AutoConfig.from_pretrained, drafter_init, "--drafter-init")
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
