"""The paper's Table 1 from the records of a run: one mode's figures over some prompts against target-only decoding
of the same prompts (summarise: speedup, tau, tok/s, TTFT, hit rate, ms per round) and their layout (table)."""

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


# ----------------------------------------------------------------------------------------------------------------------
# Aggregation and the Table 1 layout


def _mean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarise(records: list[dict], baseline: list[dict]) -> dict:
    """One mode over some prompts, against target-only decoding of the same prompts."""

    def s_per_token(recs):
        tokens = sum(r["decode_tokens"] for r in recs)
        return sum(r["decode_time"] for r in recs) / tokens if tokens else math.nan

    rounds = sum(r["num_rounds"] for r in records)
    out = {
        "speedup": s_per_token(baseline) / s_per_token(records),
        "tau": _mean(r["tau"] for r in records),
        "tokens_per_s": 1 / s_per_token(records),
        "ttft_s": _mean(r["time_prefill"] for r in records),
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
    if rounds:  # the whole round, to compare with its phases
        out["ms_per_round"]["round"] = 1000 * sum(r["decode_time"] for r in records) / rounds
    if (
        "hits_per_position" in records[0]
    ):  # async: pooled over rounds (index k-1: rejection at k; last: all accepted)
        for k in ("hits_per_position", "misses_per_position"):
            out[k] = [sum(col) for col in zip(*(r[k] for r in records))]
        hits, misses = sum(out["hits_per_position"]), sum(out["misses_per_position"])
        out["hit_rate"] = hits / max(1, hits + misses)
    return out


def table(results: dict, overall: dict, modes: list[str], block_size: int) -> str:
    """Rows: modes; columns: per dataset speedup and tau, then their mean (the paper's Table 1). Below, over all
    datasets: decode speed, time to first token, hit rate and where the time of a round goes (round = decode time
    / rounds; the phases may sum to less: acceptance, bookkeeping; on GPU async verify and packed draft overlap).
    "overlap": for async, what running verify and the packed pass side by side saved, measured, in ms per round
    (below zero where it cost time)."""
    names = list(results) + ["Avg."]
    lines = [
        " " * 26 + "".join(f"{n[:17]:<18}" for n in names),
        f"{'Method':<26}" + "Speedup  τ       " * len(names),
    ]
    for mode in modes:
        cells = [results[n]["modes"][mode] for n in results]
        cells.append({k: _mean(c[k] for c in cells) for k in ("speedup", "tau")})
        drafts = mode != "hf" and not mode.startswith(
            "target"
        )  # plain generate and target-only draft nothing
        label = f"{mode} ({block_size})" if drafts else mode
        lines.append(
            f"{label:<26}"
            + "".join(
                f"{c['speedup']:6.2f}× "
                + (f"{c['tau']:5.2f}    " if not math.isnan(c["tau"]) else "    -    ")
                for c in cells
            )
        )
    if "hf" in overall:
        ratio = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
        lines.append(
            f"target-only (this repo) vs transformers generate: {ratio:.2f}× (output tokens per s, "
            "all datasets; speedups above are against this repo's target-only decoding)"
        )
        if (
            ratio < 1
        ):  # a slower baseline would inflate every speedup: say what they are against the faster one
            lines.append(
                "against transformers generate (the faster baseline here): "
                + ", ".join(
                    f"{m} {overall[m]['tokens_per_s'] / overall['hf']['tokens_per_s']:.2f}×"
                    for m in modes
                    if m != "hf"
                )
            )
    targets = [m for m in ["target"] + modes if m.split("+")[0] == "target"]
    if (
        len(targets) > 1
    ):  # target-only in more than one setting: the speedups against the fastest of them too
        fastest = max(targets, key=lambda m: overall[m]["tokens_per_s"])
        lines.append(
            f"against the fastest target-only ({fastest}, {overall[fastest]['tokens_per_s']:.1f} tok/s): "
            + ", ".join(
                f"{m} {overall[m]['tokens_per_s'] / overall[fastest]['tokens_per_s']:.2f}×"
                for m in modes
                if m not in targets
            )
        )
    phases = (
        ["round"]
        + [
            k[5:]
            for k in TIME_KEYS
            if k != "time_overlap_saved"  # that is the overlap column
            and any(overall[m]["ms_per_round"].get(k[5:], 0) for m in modes)
        ]
    )  # (launch: CUDA only)
    lines.append(
        f"\n{'all datasets':<22}{'tok/s':>8}{'TTFT ms':>9}{'hit rate':>9}{'overlap ms':>11}   ms per round: "
        + " / ".join(phases)
        + ("  (draft = packed + fallback)" if "packed_draft" in phases else "")
    )
    for mode in ["target"] + modes:
        o = overall[mode]
        per_round = [
            f"{o['ms_per_round'][p]:.2f}" if p in o["ms_per_round"] else "-" for p in phases
        ]
        overlap = (
            f"{o['ms_per_round']['overlap_saved']:.2f}"
            if "overlap_saved" in o["ms_per_round"]
            else "-"
        )
        lines.append(
            f"{mode:<22}{o['tokens_per_s']:8.1f}{1000 * o['ttft_s']:9.1f}"
            f"{format(o['hit_rate'], '.0%') if 'hit_rate' in o else '-':>9}{overlap:>11}   "
            + (" / ".join(per_round) if mode.split("+")[0] != "target" else "-")
        )
    return "\n".join(lines)
