"""The modes of a run and one prompt decoded in each: parse_mode reads a mode as --mode and --modes name it,
decode_prompt decodes a prompt in every mode of a run and keeps the record that the drivers and the benches time,
prepare makes the run's KV caches (and compiled passes) once; encode makes a prompt's ids."""

from __future__ import annotations

import torch

import d3d
import runtime
from systems import fast, peers


def available_modes() -> tuple[str, ...]:
    return d3d.MODES


def parse_mode(spec: str) -> tuple[str, dict]:
    """'sync', 'async', 'async:C,F[,cover]' (a branch budget to sweep, the paper's Fig. 3), or a transformers
    baseline (peers.BASELINES): (mode, overrides). A D3D mode or 'target' may end in '+compiled' (its passes compiled,
    beside the eager ones in the same run) and '+2lanes' (async: the packed pass in a second lane)."""
    spec, *setting = spec.split("+")
    if any(s not in ("compiled", "2lanes") for s in setting) or (
        setting and spec.split(":")[0] in peers.BASELINES
    ):
        raise runtime.UserError(
            f"unknown setting in {'+'.join([spec, *setting])!r}: a D3D mode or target may end in "
            "+compiled and +2lanes (async), e.g. sync+compiled async+compiled+2lanes"
        )
    flags = {"compiled": True} if "compiled" in setting else {}
    flags.update({"lanes": 2} if "2lanes" in setting else {})
    mode, overrides = _parse_budget(spec)
    return mode, {**overrides, **flags}


def _parse_budget(spec: str) -> tuple[str, dict]:
    mode, _, budget = spec.partition(":")
    if mode in peers.BASELINES and not budget:
        return mode, {}
    if mode not in available_modes() or (budget and mode != "async"):
        raise runtime.UserError(
            f"unknown mode {spec!r}: use one of {', '.join(available_modes() + peers.BASELINES)} "
            "or async:C,F[,cover]"
        )
    if not budget:
        return mode, {}
    parts = budget.split(",")
    try:
        overrides = {"coverage": int(parts[0]), "fanout": int(parts[1])}
    except (ValueError, IndexError):
        raise runtime.UserError(
            f"bad async budget {spec!r}: write async:C,F or async:C,F,likely (e.g. async:12,2)"
        )
    if len(parts) > 2:
        overrides["cover"] = parts[2]
    return mode, overrides


def encode(tok, text: str, thinking: bool, device) -> torch.Tensor:
    """Prompt ids (1, n): the chat template if the tokenizer has one (Qwen3: thinking off unless asked)."""
    if not text.strip():
        raise runtime.UserError("empty prompt: give some text to answer")
    if not tok.chat_template:
        return torch.tensor([tok(text).input_ids], device=device)
    text = tok.apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    return torch.tensor([tok(text, add_special_tokens=False).input_ids], device=device)


# ----------------------------------------------------------------------------------------------------------------------
# One prompt in every mode


def generate_kwargs(mode: str, opts: dict, eos, max_new_tokens, device) -> dict:
    """d3d.generate's keyword arguments for one mode, a fresh seeded generator each (the same draws in every mode)."""
    kwargs = {
        "max_new_tokens": max_new_tokens or opts["max_new_tokens"],
        "mode": mode,
        "eos_token_id": eos,
        "temperature": opts["temperature"],
        "generator": torch.Generator(device).manual_seed(opts["seed"]),
    }
    if mode != "target":
        kwargs["block_size"] = opts["block_size"]
    return kwargs


def decode_prompt(models, ids, modes, opts, max_new_tokens=None) -> dict[str, dict]:
    """{mode: d3d.generate's stats (peers.hf_decode's for a baseline) + new_tokens, decode_time, decode_tokens} for each
    mode, in order."""
    target, drafter, _, eos, _ = models
    records = {}
    for spec in modes:
        mode, overrides = parse_mode(spec)
        if mode in peers.BASELINES:
            records[spec] = peers.hf_decode(
                models, ids, mode, opts, max_new_tokens or opts["max_new_tokens"]
            )
            continue
        kwargs = generate_kwargs(mode, opts, eos, max_new_tokens, ids.device)
        compiled = overrides.pop("compiled", False) or opts.get("compile")
        kwargs["caches"] = opts.get(
            "compiled_caches" if compiled else "caches"
        )  # the run's KV caches (prepare)
        lanes = overrides.pop(
            "lanes", opts.get("lanes")
        )  # None: generate's rule (runtime.async_lanes)
        if (
            mode == "async"
        ):  # branch budget C x F and which positions (plan_branches); unset = d3d's defaults
            kwargs.update(
                {k: opts[k] for k in ("coverage", "fanout", "cover") if opts[k] is not None},
                **overrides,
            )
            kwargs["lanes"] = lanes
        if opts.get("keep_ratio") is not None:  # selective prefilling (lossy, off by default)
            kwargs.update(keep_ratio=opts["keep_ratio"], chunk_size=opts["chunk_size"])
        if opts.get("trace"):  # the phases as a Chrome trace (decode.py's write_trace)
            kwargs["trace"] = True
        use_drafter = mode != "target" or opts.get("keep_ratio") is not None
        out, stats = d3d.generate(target, drafter if use_drafter else None, ids, **kwargs)
        records[spec] = {
            **stats,
            "new_tokens": out[0, ids.shape[1] :].tolist(),
            "decode_time": stats["time_total"]
            - stats["time_prefill"],  # the first token is prefill's
            "decode_tokens": max(stats["num_new_tokens"] - 1, 0),
        }
        if (
            "time_both" in stats
        ):  # what running verification and the packed pass side by side saved (< 0: cost)
            records[spec]["time_overlap_saved"] = (
                stats["time_verify"] + stats["time_packed_draft"] - stats["time_both"]
            )
    return records


def prepare(models, opts: dict, all_ids: list[torch.Tensor], modes: list[str]) -> None:
    """Once per run, before the warm-up: the KV caches of fixed size every request reuses (opts["caches"]; --max-len,
    else the longest prompt + --max-new-tokens + the widest pass of `modes`), and with --compile or a '+compiled'
    mode a second pair (opts["compiled_caches"]) whose fixed-shape passes are compiled, every shape warmed up
    (opts["compile_seconds"], printed: compile time is not decode time)."""
    target, drafter = models[0], models[1]
    block_size = opts["block_size"] or (drafter.d3d_config.block_size if drafter is not None else 1)
    widest = 0
    for spec in modes:
        mode, overrides = parse_mode(spec)
        budget = d3d.default_budget(block_size)
        coverage = overrides.get(
            "coverage", opts["coverage"] if opts["coverage"] is not None else budget[0]
        )
        fanout = overrides.get(
            "fanout", opts["fanout"] if opts["fanout"] is not None else budget[1]
        )
        widest = max(
            widest, runtime.cache_len(0, 0, block_size, coverage * (mode == "async"), fanout)
        )
    new_tokens = max(
        opts["max_new_tokens"], 16, 2 * block_size + 3
    )  # the warm-ups decode up to this many
    need = max(x.shape[1] for x in all_ids) + new_tokens + widest
    if opts.get("max_len") and opts["max_len"] < need:
        raise runtime.UserError(
            f"--max-len {opts['max_len']} is too small for these prompts: they need {need} KV slots "
            "(the longest prompt + --max-new-tokens + the widest pass)"
        )
    use_drafter = (
        drafter
        if any(parse_mode(m)[0] not in ("target", *peers.BASELINES) for m in modes)
        else None
    )
    opts["caches"] = runtime.Caches.make(target, use_drafter, opts.get("max_len") or need)
    compiled = [m for m in modes if opts.get("compile") or parse_mode(m)[1].get("compiled")]
    if compiled:
        opts["compiled_caches"] = runtime.Caches.make(
            target, use_drafter, opts.get("max_len") or need
        )
        fast.compile_passes(opts["compiled_caches"], regional=opts.get("compile") == "regional")
        opts["compile_seconds"] = 0.0
        for spec in dict.fromkeys(
            m.replace("+compiled", "") for m in compiled if parse_mode(m)[0] not in peers.BASELINES
        ):
            mode, overrides = parse_mode(
                spec
            )  # each shape it uses (an async budget sets the packed pass's)
            settings = {
                k: opts[k] for k in ("coverage", "fanout", "cover") if opts[k] is not None
            } | overrides
            if (
                mode == "async"
            ):  # a CPU's two lanes run with half the threads each, which dynamo's guards see
                settings.setdefault("lanes", opts.get("lanes"))
            opts["compile_seconds"] += fast.warm_up(
                target,
                use_drafter,
                opts["compiled_caches"],
                all_ids[0][:, :8],
                [mode],
                block_size=opts["block_size"],
                **settings,
            )
        print(
            f"compiled the fixed-shape passes of {', '.join(compiled)} in {opts['compile_seconds']:.1f} s "
            "(not counted in any time below)"
        )
