"""The paper's Table 1 from the records of a run: one mode's figures over some prompts against
target-only decoding of the same prompts (summarise: speedup, tau, tok/s, TTFT, hit rate, ms
per round) and their layout (table)."""

from __future__ import annotations

import collections
import math

TIME_KEYS = (
    "time_draft",
    "time_verify",
    "time_packed_draft",
    "time_fallback_draft",
    "time_overlap_saved",
    "time_verify_launch",
    "time_packed_draft_launch",
)


# ---------------------------------------------------------------------------------------------
# Aggregation and the Table 1 layout


def nanmean(values):
    """The mean of the values that are numbers (None and NaN left out); NaN if none is."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan
    return sum(values) / len(values)


def s_per_token(records: list[dict]) -> float:
    """Decode seconds per output token, summed over some prompts (prefill excluded)."""
    tokens = sum(r["decode_tokens"] for r in records)
    if not tokens:
        return math.nan
    return sum(r["decode_time"] for r in records) / tokens


def summarise(records: list[dict], baseline: list[dict]) -> dict:
    """One mode over some prompts, against target-only decoding of the same prompts."""
    rounds = sum(r["num_rounds"] for r in records)
    out = {
        "speedup": s_per_token(baseline) / s_per_token(records),
        "tau": nanmean(r["tau"] for r in records),
        "tokens_per_s": 1 / s_per_token(records),
        "ttft_s": nanmean(r["time_prefill"] for r in records),
        "num_rounds": rounds,
        "num_new_tokens": sum(r["num_new_tokens"] for r in records),
        "histogram": dict(
            sorted(collections.Counter(n for r in records for n in r["accept_lengths"]).items())
        ),
        "ms_per_round": {
            k[5:]: 1000 * sum(r[k] for r in records) / max(rounds, 1)
            for k in TIME_KEYS
            if k in records[0]
        },
    }
    if rounds:
        # the whole round, to compare with its phases
        out["ms_per_round"]["round"] = 1000 * sum(r["decode_time"] for r in records) / rounds
    if "hits_per_position" in records[0]:
        # async: pooled over rounds (index k-1: rejection at k; last: all accepted)
        for k in ("hits_per_position", "misses_per_position"):
            out[k] = [sum(col) for col in zip(*(r[k] for r in records))]
        hits = sum(out["hits_per_position"])
        misses = sum(out["misses_per_position"])
        out["hit_rate"] = hits / max(1, hits + misses)
    return out


def or_dash(value, spec: str) -> str:
    """A table's entry: `value` formatted by `spec`, "-" where there is none (None or NaN)."""
    if value is None or math.isnan(value):
        return "-"
    return format(value, spec)


def mean_over_datasets(results: dict, mode: str) -> dict:
    """A mode's Avg. column of Table 1: its speedup and tau, each the mean over the datasets."""
    cells = [results[n]["modes"][mode] for n in results]
    return {k: nanmean(c[k] for c in cells) for k in ("speedup", "tau")}


def _cell(c: dict) -> str:
    """One Table 1 cell: the speedup and tau ("-" where a mode has no rounds)."""
    return f"{c['speedup']:6.2f}× {or_dash(c['tau'], '5.2f'):>5}    "


def _ratios(overall: dict, modes: list[str], baseline: str) -> str:
    """Each mode's output tokens per second over the baseline's: 'sync 1.20×, ...'."""
    base = overall[baseline]["tokens_per_s"]
    shown = [f"{m} {overall[m]['tokens_per_s'] / base:.2f}×" for m in modes]
    return ", ".join(shown)


def table(results: dict, overall: dict, modes: list[str], block_size: int) -> str:
    """Rows: modes; columns: per dataset speedup and tau, then their mean (the paper's Table 1).
    Below, over all datasets: decode speed, time to first token, hit rate and where the time of
    a round goes (round = decode time / rounds; the phases may sum to less: acceptance,
    bookkeeping; on GPU async verify and packed draft overlap). "overlap": for async, what
    running verify and the packed pass side by side saved, measured, in ms per round (below
    zero where it cost time)."""
    names = list(results) + ["Avg."]
    # target-only decoding, eager or compiled ("target+compiled")
    targets = [m for m in ["target"] + modes if m.split("+")[0] == "target"]
    lines = [
        " " * 26 + "".join(f"{n[:17]:<18}" for n in names),
        f"{'Method':<26}" + "Speedup  τ       " * len(names),
    ]
    for mode in modes:
        cells = [results[n]["modes"][mode] for n in results]
        cells.append(mean_over_datasets(results, mode))
        label = mode
        # plain generate and target-only draft nothing
        if mode != "hf" and mode not in targets:
            label = f"{mode} ({block_size})"
        lines.append(f"{label:<26}" + "".join(_cell(c) for c in cells))
    lines.append("τ: per dataset, the mean of per-prompt means; Avg.: the mean over the datasets")
    if "hf" in overall:
        ratio = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
        lines.append(
            f"target-only (this repo) vs transformers generate: {ratio:.2f}× (output tokens "
            "per s, all datasets; speedups above are against this repo's target-only decoding)"
        )
        if ratio < 1:
            # a slower baseline would inflate every speedup: say what they are against the
            # faster one
            others = [m for m in modes if m != "hf"]
            lines.append(
                "against transformers generate (the faster baseline here): "
                + _ratios(overall, others, "hf")
            )
    if len(targets) > 1:
        # target-only in more than one setting: the speedups against the fastest of them too
        fastest = max(targets, key=lambda m: overall[m]["tokens_per_s"])
        others = [m for m in modes if m not in targets]
        lines.append(
            f"against the fastest target-only ({fastest}, "
            f"{overall[fastest]['tokens_per_s']:.1f} tok/s): " + _ratios(overall, others, fastest)
        )
    # (launch: CUDA only)
    phases = ["round"]
    for k in TIME_KEYS:
        # time_overlap_saved is the overlap column
        measured = any(overall[m]["ms_per_round"].get(k[5:], 0) for m in modes)
        if k != "time_overlap_saved" and measured:
            phases.append(k[5:])
    header = (
        f"\n{'all datasets':<22}{'tok/s':>8}{'TTFT ms':>9}{'hit rate':>9}{'overlap ms':>11}"
        "   ms per round: " + " / ".join(phases)
    )
    if "packed_draft" in phases:
        header += "  (draft = packed + fallback)"
    lines.append(header)
    for mode in ["target"] + modes:
        o = overall[mode]
        ms = o["ms_per_round"]
        per_round = "-"
        if mode not in targets:
            per_round = " / ".join(or_dash(ms.get(p), ".2f") for p in phases)
        overlap = or_dash(ms.get("overlap_saved"), ".2f")
        hit_rate = or_dash(o.get("hit_rate"), ".0%")
        lines.append(
            f"{mode:<22}{o['tokens_per_s']:8.1f}{1000 * o['ttft_s']:9.1f}"
            f"{hit_rate:>9}{overlap:>11}   " + per_round
        )
    return "\n".join(lines)
