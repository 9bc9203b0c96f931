"""The benchmarks beside Table 1, each a decode.py flag: lossless sampling measured (sampling_check, --sampling-check),
concurrent requests as one batch (concurrency_bench, the paper's Table 2, --concurrency) and selective prefilling on
long prompts (prefill_bench, the paper's Tables 6-7 in miniature, --prefill-bench)."""

from __future__ import annotations

import collections
import math
import os
import re

import torch
from tqdm.auto import tqdm

from systems import batched, decoding, figures, forensics

# ----------------------------------------------------------------------------------------------------------------------
# Lossless sampling, measured


def sampling_check(
    models, prompt: str, mode: str, opts: dict, thinking: bool, num_samples: int
) -> dict:
    """Lossless speculative sampling, measured: `num_samples` answers to one prompt by target-only sampling and by
    `mode`, each answer from its own seed, then per position the total variation distance between the two empirical
    distributions of the token there (an answer that ended counts as one more outcome). A second target-only set
    shows the distance that sampling noise alone gives: a lossless mode stays near it, a biased one rises above."""
    ids = decoding.encode(models[2], prompt, thinking, models[0].device)
    decoding.prepare(models, opts, [ids], ["target", mode])
    sets = {"target": "target", mode: mode, "target, again": "target"}
    answers = {}
    bar = tqdm(
        total=len(sets) * num_samples, desc="sampling check", unit="answer", dynamic_ncols=True
    )
    for k, (name, m) in enumerate(sets.items()):
        answers[name] = []
        for i in range(num_samples):  # seeds never shared between sets
            seed = (opts["seed"] * len(sets) + k) * num_samples + i
            answers[name].append(
                decoding.decode_prompt(models, ids, [m], {**opts, "seed": seed})[m]["new_tokens"]
            )
            bar.update(1)
    bar.close()

    def distance(
        a, b, position
    ):  # total variation between the token laws at `position` (-1: the answer ended)
        ca, cb = (
            collections.Counter(r[position] if position < len(r) else -1 for r in rows)
            for rows in (a, b)
        )
        return 0.5 * sum(abs(ca[t] - cb[t]) for t in ca.keys() | cb.keys()) / num_samples

    length = max(len(r) for rows in answers.values() for r in rows)
    rows = [
        (
            p,
            distance(answers[mode], answers["target"], p),
            distance(answers["target, again"], answers["target"], p),
        )
        for p in range(length)
    ]
    print(
        f"\nsampling check at temperature {opts['temperature']}: {num_samples} answers per set, prompt {prompt!r}\n"
        f"{'position':>8}  TV({mode}, target)  TV(target, target again)"
    )
    for p, spec, noise in rows:
        print(
            f"{p + 1:>8}  {spec:>16.3f}  {noise:>24.3f}"
            + ("   (the target's prefill token)" if p == 0 else "")
        )
    mean = {k: sum(r[i] for r in rows) / len(rows) for i, k in ((1, mode), (2, "target, again"))}
    print(f"{'mean':>8}  {mean[mode]:>16.3f}  {mean['target, again']:>24.3f}")
    return {
        "positions": [{"tv_mode": a, "tv_noise": b} for _, a, b in rows],
        "mean_tv_mode": mean[mode],
        "mean_tv_noise": mean["target, again"],
        "num_samples": num_samples,
        "mode": mode,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Table 2: concurrent requests


def decode_group(
    models, group: list[torch.Tensor], modes: list[str], opts: dict, max_new_tokens=None
) -> dict:
    """One group of concurrent requests (prompt ids (1, n) each) in every mode: {mode: batch stats + new_tokens per
    row}. Target and sync decode the group as one batch (batched.generate); async only a group of 1."""
    target, drafter, _, eos, _ = models
    records = {}
    for spec in modes:
        mode, overrides = decoding.parse_mode(spec)
        if mode == "async":  # the batch-1 loop; decode_prompt's record carries the same totals
            r = decoding.decode_prompt(models, group[0], [spec], opts, max_new_tokens)[spec]
            records[spec] = {**r, "new_tokens": [r["new_tokens"]]}
            continue
        kwargs = decoding.generate_kwargs(mode, opts, eos, max_new_tokens, target.device)
        batch = [ids[0] for ids in group]  # 1-D prompts of different lengths
        outs, stats = batched.generate(
            target, drafter if mode != "target" else None, batch, **kwargs
        )
        records[spec] = {
            **{k: v for k, v in stats.items() if k != "rows"},
            "accept_lengths": [n for row in stats["rows"] for n in row["accept_lengths"]],
            "new_tokens": [out[ids.shape[1] :].tolist() for out, ids in zip(outs, group)],
        }
    return records


def summarise_concurrent(records: list[dict], baseline: list[dict]) -> dict:
    """One mode at one concurrency over consecutive groups: throughput = new tokens of all requests / wall time of
    the batches (prefill included), speedup over target-only of the same groups, where a round's time goes."""

    def throughput(recs):
        return sum(r["num_new_tokens"] for r in recs) / sum(r["time_total"] for r in recs)

    rounds = max(1, sum(r["num_rounds"] for r in records))
    ms = {k: 1000 * sum(r[f"time_{k}"] for r in records) / rounds for k in ("draft", "verify")}
    ms["round"] = 1000 * sum(r["time_total"] - r["time_prefill"] for r in records) / rounds
    ms["other"] = ms["round"] - ms["draft"] - ms["verify"]  # acceptance, commits, cache bookkeeping
    return {
        "tokens_per_s": throughput(records),
        "speedup": throughput(records) / throughput(baseline),
        "num_new_tokens": sum(r["num_new_tokens"] for r in records),
        "num_batches": len(records),
        "wall_s": sum(r["time_total"] for r in records),
        "num_rounds": sum(r["num_rounds"] for r in records),
        "tau": figures._mean(
            n for r in records for n in r["accept_lengths"]
        ),  # over all rows' rounds
        "ms_per_round": ms,
        "prefill_ms_per_batch": 1000 * figures._mean(r["time_prefill"] for r in records),
    }


def concurrency_table(
    results: dict, overall: dict, levels: list[int], modes: list[str], block_size: int
) -> str:
    """The paper's Table 2: per dataset, rows = modes, columns = concurrency, cells = throughput (tokens/s over wall
    time) and speedup over target-only at the same concurrency. Below, over all datasets, where a round goes."""
    lines = [
        "throughput in tokens/s over wall time (speedup over target-only at the same concurrency)"
    ]
    for name, result in results.items():
        title = f"{name} ({result['num_prompts']} prompts)"
        lines.append(f"\n{title:<27}" + "".join(f"{'c=' + str(c):<18}" for c in levels))
        for mode in ["target"] + modes:
            cells = [result["levels"][c].get(mode) for c in levels]
            cells = [f"{x['tokens_per_s']:.1f} ({x['speedup']:.2f}×)" if x else "-" for x in cells]
            lines.append(
                f"{mode if mode == 'target' else f'{mode} ({block_size})':<27}"
                + "".join(f"{x:<18}" for x in cells)
            )
    if any(decoding.parse_mode(m)[0] == "async" for m in modes) and max(levels) > 1:
        lines.append(
            "async runs at concurrency 1 only: batched async is not built (see systems/batched.py)"
        )
    lines.append(
        f"\nall datasets, ms per round: round = draft + verify + other (acceptance, bookkeeping); "
        f"prefill ms per batch apart\n{'mode':<24}{'c':>4}{'rounds':>8}{'tau':>7}{'round':>9}{'draft':>9}"
        f"{'verify':>9}{'other':>9}{'prefill':>9}"
    )
    for c in levels:
        for mode, o in overall[c].items():
            ms = o["ms_per_round"]
            phases = "".join(f"{ms[k]:>9.2f}" for k in ("round", "draft", "verify", "other"))
            prefill = o["prefill_ms_per_batch"]
            tau = "-" if math.isnan(o["tau"]) else f"{o['tau']:.2f}"
            lines.append(f"{mode:<24}{c:>4}{o['num_rounds']:>8}{tau:>7}{phases}{prefill:>9.1f}")
    return "\n".join(lines)


def concurrency_bench(
    models, files, modes: list[str], levels: list[int], opts: dict, thinking: bool
) -> dict:
    """Table 2: at each concurrency c, the prompts of each file in consecutive groups of c decoded as one batch,
    target-only and each speculative mode (async at c = 1 only); greedy outputs are checked row by row against
    target-only decoding of the same group."""
    target, _, tok, _, info = models
    datasets = {}
    for path, field, prompts in files:
        name = os.path.splitext(os.path.basename(path))[0]
        datasets[name if name not in datasets else f"{name}-{len(datasets)}"] = (
            path,
            field,
            [decoding.encode(tok, p, thinking, target.device) for p in prompts],
        )
    results, mismatches, everything = (
        {},
        [],
        collections.defaultdict(lambda: collections.defaultdict(list)),
    )
    for name, (path, field, prompts) in datasets.items():
        results[name] = {"path": path, "field": field, "num_prompts": len(prompts), "levels": {}}
        for c in levels:
            run = ["target"] + [m for m in modes if c == 1 or decoding.parse_mode(m)[0] != "async"]
            decode_group(
                models, prompts[:c], run, opts, max_new_tokens=16
            )  # warm-up at this batch size
            records = collections.defaultdict(list)
            groups = [prompts[i : i + c] for i in range(0, len(prompts), c)]
            for g, group in enumerate(
                tqdm(groups, desc=f"{name} c={c}", unit="batch", dynamic_ncols=True)
            ):
                for mode, r in decode_group(models, group, run, opts).items():
                    records[mode].append(r)
                    for row, (ref, new) in enumerate(
                        zip(records["target"][-1]["new_tokens"], r["new_tokens"])
                    ):
                        found = forensics.divergence(
                            target,
                            tok,
                            group[row],
                            ref,
                            new,
                            opts,
                            dataset=name,
                            concurrency=c,
                            mode=mode,
                            prompt_index=g * c + row,
                        )
                        mismatches += [found] if found else []
            results[name]["levels"][c] = {
                m: summarise_concurrent(records[m], records["target"]) for m in run
            }
            for m in run:
                everything[c][m] += records[m]
                results[name]["levels"][c][m]["mismatches"] = sum(
                    (x["dataset"], x["concurrency"], x["mode"]) == (name, c, m) for x in mismatches
                )
    overall = {
        c: {
            m: summarise_concurrent(everything[c][m], everything[c]["target"])
            for m in everything[c]
        }
        for c in levels
    }
    block_size = opts["block_size"] or info["drafter_config"]["block_size"]
    text = concurrency_table(results, overall, levels, modes, block_size)
    checked = sum(
        len(r["new_tokens"])
        for c in levels
        for m in everything[c]
        if m != "target"
        for r in everything[c][m]
    )
    check = (
        "greedy check skipped: at temperature > 0 the outputs are samples"
        if opts["temperature"]
        else forensics.greedy_check(
            mismatches, checked, against="target-only at the same concurrency"
        )
    )
    print(f"\n{text}\n\n{check}")
    counts = collections.Counter(x["class"] for x in mismatches)
    return {
        "concurrency": levels,
        "datasets": results,
        "overall": overall,
        "block_size": block_size,
        "table": text,
        "mismatches": {
            "count": len(mismatches),
            "checked": checked,
            "identical": checked - len(mismatches),
            "near_ties": counts["near-tie"],
            "errors": counts["error"],
            "list": mismatches,
        },
    }


# ----------------------------------------------------------------------------------------------------------------------
# Selective prefilling on long prompts


def long_prompts(docs: list[str], num_docs: int, count: int, seed: int) -> list[tuple[str, int]]:
    """Long prompts from real text: `num_docs` problems one after another, then a request to solve one of them
    (the paper's LongBench single-document QA in miniature). Returns (prompt, index of the asked problem)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        chosen = [docs[(i * num_docs + k) % len(docs)] for k in range(num_docs)]
        asked = int(torch.randint(1, num_docs + 1, (1,), generator=rng))
        body = "\n\n".join(f"Problem {k + 1}: {doc}" for k, doc in enumerate(chosen))
        prompts.append(
            (
                f"Here are {num_docs} math problems.\n\n{body}\n\nSolve problem {asked} step by step and "
                f"give its final answer. Ignore the other problems.",
                asked,
            )
        )
    return prompts


def prefill_bench(
    models,
    path: str,
    docs: list[str],
    mode: str,
    keep_ratios: list[float],
    num_docs: int,
    count: int,
    opts: dict,
    thinking: bool,
) -> dict:
    """Selective prefilling (paper Tables 6-7 in miniature): per long prompt, target-only decoding with full prefill
    (the baseline), then `mode` with the drafter choosing the kept chunks at each keep ratio (1.0 = full prefill,
    the drafter's scoring pass included in TTFT). TTFT, decode and end-to-end speedups are ratios to the baseline
    in the same run; "same answer" compares the whole output, "same number" its last number, with the baseline's."""
    target, _, tok, _, _ = models
    prompts = long_prompts(docs, num_docs, count, opts["seed"])
    ids = [decoding.encode(tok, p, thinking, target.device) for p, _ in prompts]
    rows = {"target, full prefill": None} | {f"{r:.0%} + D3D ({mode})": r for r in keep_ratios}
    last_number = lambda toks: (re.findall(r"-?\d[\d,]*\.?\d*", tok.decode(toks)) or [None])[-1]  # noqa: E731
    records = collections.defaultdict(list)
    decoding.prepare(models, opts, ids, ["target", mode])
    decoding.decode_prompt(models, ids[0], ["target"], opts, max_new_tokens=4)  # warm-up
    for x in tqdm(ids, desc="long prompts", unit="prompt", dynamic_ncols=True):
        for name, ratio in rows.items():
            row_opts = {**opts, "keep_ratio": ratio}
            records[name].append(
                decoding.decode_prompt(
                    models, x, ["target" if ratio is None else mode], row_opts
                ).popitem()[1]
            )
    base = records["target, full prefill"]

    def per_token(recs, key, tokens):
        return sum(r[key] for r in recs) / max(1, sum(r[tokens] for r in recs))

    table_rows, result = [], {}
    for name, recs in records.items():
        result[name] = {
            "same_answer": figures._mean(
                float(r["new_tokens"] == b["new_tokens"]) for r, b in zip(recs, base)
            ),
            "same_number": figures._mean(
                float(last_number(r["new_tokens"]) == last_number(b["new_tokens"]))
                for r, b in zip(recs, base)
            ),
            "ttft_s": figures._mean(r["time_prefill"] for r in recs),
            "ttft_speedup": figures._mean(b["time_prefill"] for b in base)
            / figures._mean(r["time_prefill"] for r in recs),
            "decode_speedup": per_token(base, "decode_time", "decode_tokens")
            / per_token(recs, "decode_time", "decode_tokens"),
            "e2e_speedup": per_token(base, "time_total", "num_new_tokens")
            / per_token(recs, "time_total", "num_new_tokens"),
            "prompt_tokens": figures._mean(x.shape[1] for x in ids),
            "prompt_tokens_prefilled": figures._mean(
                r.get("prompt_tokens_prefilled", x.shape[1]) for r, x in zip(recs, ids)
            ),
            "tau": figures._mean(r["tau"] for r in recs),
        }
        o = result[name]
        table_rows.append(
            f"{name:<24}{o['same_answer']:>7.0%}{o['same_number']:>8.0%}"
            f"{o['prompt_tokens_prefilled']:>9.0f}"
            f"{1000 * o['ttft_s']:>9.0f}{o['ttft_speedup']:>7.2f}×{o['decode_speedup']:>7.2f}×"
            f"{o['e2e_speedup']:>7.2f}×{o['tau']:>7.2f}"
        )
    prompt_tokens = result[next(iter(result))]["prompt_tokens"]
    header = (
        f"{os.path.basename(path)}: {count} prompts of {num_docs} problems (~{prompt_tokens:.0f}"
        f" tokens), chunks of {opts['chunk_size']} tokens\n{'setting':<24}{'same':>7}{'number':>8}{'prefill':>9}"
        f"{'TTFT ms':>9}{'TTFT':>8}{'decode':>8}{'E2E':>8}{'τ':>7}"
    )
    text = header + "\n" + "\n".join(table_rows)
    print("\n" + text)
    return {
        "prefill_bench": result,
        "table": text,
        "num_prompts": count,
        "num_docs": num_docs,
        "chunk_size": opts["chunk_size"],
        "mode": mode,
        "source": path,
    }
