"""decode.py's benchmarks: Table 1 (table1, --bench: batch 1, each mode beside target-only
decoding, the greedy check), and beside it, each a decode.py flag: lossless sampling measured
(sampling_check, --sampling-check), concurrent requests as one batch (concurrency_bench, the
paper's Table 2, --concurrency) and selective prefilling on long prompts (prefill_bench, the
paper's Tables 6-7 in miniature, --prefill-bench)."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re

import torch
from tqdm.auto import tqdm

from systems import batched, decoding, figures, forensics

# ---------------------------------------------------------------------------------------------
# Lossless sampling, measured


def token_law(answers: list[list[int]], position: int) -> collections.Counter:
    """How often each token stands at `position` among the answers (-1: the answer ended)."""
    law = collections.Counter()
    for answer in answers:
        if position < len(answer):
            law[answer[position]] += 1
        else:
            law[-1] += 1
    return law


def distance(a: list[list[int]], b: list[list[int]], position: int) -> float:
    """Total variation between the token laws of two equal sets of answers at `position`."""
    law_a = token_law(a, position)
    law_b = token_law(b, position)
    tokens = law_a.keys() | law_b.keys()
    return 0.5 * sum(abs(law_a[t] - law_b[t]) for t in tokens) / len(a)


def sampling_check(models, plan, run) -> dict:
    """Lossless speculative sampling, measured: plan.samples answers to the plan's first prompt
    by target-only sampling and by its mode, each answer from its own seed, then per position
    the total variation distance between the two empirical distributions of the token there (an
    answer that ended counts as one more outcome). A second target-only set shows the distance
    that sampling noise alone gives: a lossless mode stays near it, a biased one rises above."""
    prompt = plan.prompts[0]
    mode = plan.mode
    num_samples = plan.samples
    ids = decoding.encode(models.tokenizer, prompt, plan.thinking, models.target.device)
    caches = decoding.prepare(models, run, [ids], ["target", mode])
    sets = {"target": "target", mode: mode, "target, again": "target"}
    answers = {}
    total = len(sets) * num_samples
    bar = tqdm(total=total, desc="sampling check", unit="answer", dynamic_ncols=True)
    for k, (name, m) in enumerate(sets.items()):
        answers[name] = []
        for i in range(num_samples):
            # seeds never shared between sets
            seed = (run.seed * len(sets) + k) * num_samples + i
            seeded = dataclasses.replace(run, seed=seed)
            records = decoding.decode_prompt(models, ids, [m], seeded, caches)
            answers[name].append(records[m]["new_tokens"])
            bar.update(1)
    bar.close()
    length = max(len(r) for rows in answers.values() for r in rows)
    print(
        f"\nsampling check at temperature {run.config.temperature}: {num_samples} answers per "
        f"set, prompt {prompt!r}\n"
        f"{'position':>8}  TV({mode}, target)  TV(target, target again)"
    )
    positions = []
    for p in range(length):
        tv_mode = distance(answers[mode], answers["target"], p)
        tv_noise = distance(answers["target, again"], answers["target"], p)
        positions.append({"tv_mode": tv_mode, "tv_noise": tv_noise})
        line = f"{p + 1:>8}  {tv_mode:>16.3f}  {tv_noise:>24.3f}"
        if p == 0:
            line += "   (the target's prefill token)"
        print(line)
    mean_mode = figures.nanmean(x["tv_mode"] for x in positions)
    mean_noise = figures.nanmean(x["tv_noise"] for x in positions)
    print(f"{'mean':>8}  {mean_mode:>16.3f}  {mean_noise:>24.3f}")
    return {
        "positions": positions,
        "mean_tv_mode": mean_mode,
        "mean_tv_noise": mean_noise,
        "num_samples": num_samples,
        "mode": mode,
    }


# ---------------------------------------------------------------------------------------------
# Table 2: concurrent requests


def decode_group(
    models, group: list[torch.Tensor], modes: list[str], run, max_new_tokens=None
) -> dict:
    """One group of concurrent requests (prompt ids (1, n) each) in every mode: {mode: batch
    stats + new_tokens per row}. Target and sync decode the group as one batch
    (batched.generate); async only a group of 1."""
    records = {}
    for spec in modes:
        mode = decoding.parse_mode(spec)[0]
        if mode == "async":
            # the batch-1 loop; decode_prompt's record carries the same totals
            r = decoding.decode_prompt(models, group[0], [spec], run, None, max_new_tokens)[spec]
            records[spec] = {**r, "new_tokens": [r["new_tokens"]]}
            continue
        config, kwargs = decoding.request(spec, models, run, None, max_new_tokens)
        # 1-D prompts of different lengths; the prompt is read whole
        batch = [ids[0] for ids in group]
        config = dataclasses.replace(config, keep_ratio=None)
        use = decoding.drafter_for(config, models.drafter)
        outs, stats = batched.generate(models.target, use, batch, config, **kwargs)
        kept = {k: v for k, v in stats.items() if k != "rows"}
        kept["accept_lengths"] = [n for row in stats["rows"] for n in row["accept_lengths"]]
        kept["new_tokens"] = [out[ids.shape[1] :].tolist() for out, ids in zip(outs, group)]
        records[spec] = kept
    return records


def throughput(records: list[dict]) -> float:
    """New tokens of all requests / wall time of the batches (prefill included)."""
    tokens = sum(r["num_new_tokens"] for r in records)
    return tokens / sum(r["time_total"] for r in records)


def summarise_concurrent(records: list[dict], baseline: list[dict]) -> dict:
    """One mode at one concurrency over consecutive groups: throughput, speedup over target-only
    of the same groups, where a round's time goes."""
    rounds = max(1, sum(r["num_rounds"] for r in records))
    ms = {}
    for k in ("draft", "verify"):
        ms[k] = 1000 * sum(r[f"time_{k}"] for r in records) / rounds
    decode_time = sum(r["time_total"] - r["time_prefill"] for r in records)
    ms["round"] = 1000 * decode_time / rounds
    # acceptance, commits, cache bookkeeping
    ms["other"] = ms["round"] - ms["draft"] - ms["verify"]
    return {
        "tokens_per_s": throughput(records),
        "speedup": throughput(records) / throughput(baseline),
        "num_new_tokens": sum(r["num_new_tokens"] for r in records),
        "num_batches": len(records),
        "wall_s": sum(r["time_total"] for r in records),
        "num_rounds": sum(r["num_rounds"] for r in records),
        # over all rows' rounds
        "tau": figures.nanmean(n for r in records for n in r["accept_lengths"]),
        "ms_per_round": ms,
        "prefill_ms_per_batch": 1000 * figures.nanmean(r["time_prefill"] for r in records),
    }


def concurrency_table(
    results: dict, overall: dict, levels: list[int], modes: list[str], block_size: int
) -> str:
    """The paper's Table 2: per dataset, rows = modes, columns = concurrency, cells = throughput
    (tokens/s over wall time) and speedup over target-only at the same concurrency. Below, over
    all datasets, where a round goes."""
    lines = [
        "throughput in tokens/s over wall time (speedup over target-only at the same concurrency)"
    ]
    for name, result in results.items():
        title = f"{name} ({result['num_prompts']} prompts)"
        lines.append(f"\n{title:<27}" + "".join(f"{'c=' + str(c):<18}" for c in levels))
        for mode in ["target"] + modes:
            cells = []
            for c in levels:
                x = result["levels"][c].get(mode)
                if x:
                    cells.append(f"{x['tokens_per_s']:.1f} ({x['speedup']:.2f}×)")
                else:
                    cells.append("-")
            label = mode
            if mode != "target":
                label = f"{mode} ({block_size})"
            lines.append(f"{label:<27}" + "".join(f"{x:<18}" for x in cells))
    if any(decoding.parse_mode(m)[0] == "async" for m in modes) and max(levels) > 1:
        lines.append(
            "async runs at concurrency 1 only: batched async is not built (see systems/batched.py)"
        )
    lines.append(
        "\nall datasets, ms per round: round = draft + verify + other (acceptance, bookkeeping); "
        "prefill ms per batch apart; tau = the mean over all rounds of every row"
    )
    lines.append(
        f"{'mode':<24}{'c':>4}{'rounds':>8}{'tau':>7}{'round':>9}{'draft':>9}"
        f"{'verify':>9}{'other':>9}{'prefill':>9}"
    )
    for c in levels:
        for mode, o in overall[c].items():
            ms = o["ms_per_round"]
            phases = "".join(f"{ms[k]:>9.2f}" for k in ("round", "draft", "verify", "other"))
            prefill = o["prefill_ms_per_batch"]
            tau = figures.or_dash(o["tau"], ".2f")
            lines.append(f"{mode:<24}{c:>4}{o['num_rounds']:>8}{tau:>7}{phases}{prefill:>9.1f}")
    return "\n".join(lines)


def concurrency_bench(models, plan, run) -> dict:
    """Table 2: at each concurrency c of plan.levels, the prompts of each file in consecutive
    groups of c decoded as one batch, target-only and each speculative mode (async at c = 1
    only); greedy outputs are checked row by row against target-only decoding of the same
    group."""
    levels = plan.levels
    datasets = decoding.encode_files(models, plan)
    results = {}
    mismatches = []
    everything = {c: collections.defaultdict(list) for c in levels}
    for name, (path, field, prompts) in datasets.items():
        results[name] = {"path": path, "field": field, "num_prompts": len(prompts), "levels": {}}
        for c in levels:
            level = ["target"]
            level += [m for m in plan.modes if c == 1 or decoding.parse_mode(m)[0] != "async"]
            records, found = level_records(models, prompts, c, level, run, name)
            mismatches += found
            cells = {}
            for m in level:
                cells[m] = summarise_concurrent(records[m], records["target"])
                everything[c][m] += records[m]
                cells[m]["mismatches"] = sum(x["mode"] == m for x in found)
            results[name]["levels"][c] = cells
    overall = {}
    checked = 0
    for c in levels:
        baseline = everything[c]["target"]
        overall[c] = {m: summarise_concurrent(everything[c][m], baseline) for m in everything[c]}
        for m in everything[c]:
            if m != "target":
                checked += sum(len(r["new_tokens"]) for r in everything[c][m])
    block_size = models.block_size(run.config)
    text = concurrency_table(results, overall, levels, plan.modes, block_size)
    against = "target-only at the same concurrency"
    return {
        "concurrency": levels,
        "datasets": results,
        "overall": overall,
        "block_size": block_size,
        "table": text,
        "mismatches": report(text, mismatches, checked, run, against=against),
    }


def level_records(models, prompts, c: int, level: list[str], run, name) -> tuple[dict, list]:
    """{mode: one record per group} of one file's prompts in consecutive groups of c, after a
    warm-up at that batch size, and each row that leaves target-only's (find_divergences)."""
    decode_group(models, prompts[:c], level, run, max_new_tokens=16)
    records = collections.defaultdict(list)
    found = []
    groups = [prompts[i : i + c] for i in range(0, len(prompts), c)]
    bar = tqdm(groups, desc=f"{name} c={c}", unit="batch", dynamic_ncols=True)
    for g, group in enumerate(bar):
        decoded = decode_group(models, group, level, run)
        for mode, r in decoded.items():
            records[mode].append(r)
        outputs = {m: r["new_tokens"] for m, r in decoded.items()}
        found += find_divergences(models, group, outputs, run, g * c, dataset=name, concurrency=c)
    return records, found


def find_divergences(models, prompts, outputs: dict, run, first: int, **where) -> list[dict]:
    """The outputs of some prompts ({mode: new tokens per prompt}) that leave target-only's of the
    same prompts, each with where it does (forensics.divergence); prompts numbered from `first`."""
    found = []
    for mode, rows in outputs.items():
        for row, (ids, reference, new) in enumerate(zip(prompts, outputs["target"], rows)):
            at = dict(where, mode=mode, prompt_index=first + row)
            x = forensics.divergence(models, ids, reference, new, run, **at)
            if x:
                found.append(x)
    return found


def report(text: str, mismatches: list[dict], checked: int, run, **against) -> dict:
    """Print a benchmark's table and its greedy check below (skipped at temperature > 0);
    returns the check's counts for the JSON (forensics.tally)."""
    check = "greedy check skipped: at temperature > 0 the outputs are samples"
    if not run.config.temperature:
        check = forensics.greedy_check(mismatches, checked, **against)
    print(f"\n{text}\n\n{check}")
    return forensics.tally(mismatches, checked)


# ---------------------------------------------------------------------------------------------
# Selective prefilling on long prompts


def long_prompts(docs: list[str], num_docs: int, count: int, seed: int) -> list[tuple[str, int]]:
    """Long prompts from real text: `num_docs` problems one after another, then a request to
    solve one of them (the paper's LongBench single-document QA in miniature). Returns (prompt,
    index of the asked problem)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        chosen = [docs[(i * num_docs + k) % len(docs)] for k in range(num_docs)]
        asked = int(torch.randint(1, num_docs + 1, (1,), generator=rng))
        body = "\n\n".join(f"Problem {k + 1}: {doc}" for k, doc in enumerate(chosen))
        prompt = (
            f"Here are {num_docs} math problems.\n\n{body}\n\nSolve problem {asked} step by "
            "step and give its final answer. Ignore the other problems."
        )
        prompts.append((prompt, asked))
    return prompts


def last_number(text: str) -> str | None:
    """The last number written in a text (an answer's final answer), None if there is none."""
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not numbers:
        return None
    return numbers[-1]


def per_token(records: list[dict], key: str, tokens: str) -> float:
    """Seconds of `key` per token of `tokens`, summed over some records."""
    return sum(r[key] for r in records) / max(1, sum(r[tokens] for r in records))


def prefill_bench(models, plan, run) -> dict:
    """Selective prefilling (paper Tables 6-7 in miniature): per long prompt, target-only
    decoding with full prefill (the baseline), then the plan's mode with the drafter choosing
    the kept chunks at each of plan.keep_ratios (1.0 = full prefill, the drafter's scoring pass
    included in TTFT). TTFT, decode and end-to-end speedups are ratios to the baseline in the
    same run; "same answer" compares the whole output, "same number" its last number, with the
    baseline's."""
    path, _, docs = plan.files[0]
    count = plan.num_long_prompts
    # the rows below set their own keep ratio
    run = dataclasses.replace(run, config=dataclasses.replace(run.config, keep_ratio=None))
    prompts = long_prompts(docs, plan.num_docs, count, run.seed)
    device = models.target.device
    ids = [decoding.encode(models.tokenizer, p, plan.thinking, device) for p, _ in prompts]
    # each row: (its mode, its run); the baseline's run prefills the whole prompt
    rows = {"target, full prefill": ("target", run)}
    for r in plan.keep_ratios:
        config = dataclasses.replace(run.config, keep_ratio=r)
        rows[f"{r:.0%} + D3D ({plan.mode})"] = (plan.mode, dataclasses.replace(run, config=config))
    records = collections.defaultdict(list)
    caches = decoding.prepare(models, run, ids, ["target", plan.mode])
    # warm-up
    decoding.decode_prompt(models, ids[0], ["target"], run, caches, max_new_tokens=4)
    for x in tqdm(ids, desc="long prompts", unit="prompt", dynamic_ncols=True):
        for name, (mode, row) in rows.items():
            records[name].append(decoding.decode_prompt(models, x, [mode], row, caches)[mode])
    result = {}
    for name, recs in records.items():
        result[name] = prefill_cells(models.tokenizer, recs, records["target, full prefill"], ids)
    text = prefill_table(result, path, plan, run.config.chunk_size)
    print("\n" + text)
    return {
        "prefill_bench": result,
        "table": text,
        "num_prompts": count,
        "num_docs": plan.num_docs,
        "chunk_size": run.config.chunk_size,
        "mode": plan.mode,
        "source": path,
    }


def prefill_table(result: dict, path: str, plan, chunk_size: int) -> str:
    """The prefill bench's table: a row per setting (prefill_cells), under a line that says what
    the long prompts were."""
    lines = [
        f"{os.path.basename(path)}: {plan.num_long_prompts} prompts of {plan.num_docs} problems "
        f"(~{result[next(iter(result))]['prompt_tokens']:.0f} tokens), chunks of "
        f"{chunk_size} tokens; τ = the mean of per-prompt means",
        f"{'setting':<24}{'same':>7}{'number':>8}{'prefill':>9}"
        f"{'TTFT ms':>9}{'TTFT':>8}{'decode':>8}{'E2E':>8}{'τ':>7}",
    ]
    for name, o in result.items():
        lines.append(
            f"{name:<24}{o['same_answer']:>7.0%}{o['same_number']:>8.0%}"
            f"{o['prompt_tokens_prefilled']:>9.0f}{1000 * o['ttft_s']:>9.0f}"
            f"{o['ttft_speedup']:>7.2f}×{o['decode_speedup']:>7.2f}×{o['e2e_speedup']:>7.2f}×"
            f"{o['tau']:>7.2f}"
        )
    return "\n".join(lines)


def prefill_cells(tok, records: list[dict], base: list[dict], ids: list[torch.Tensor]) -> dict:
    """One setting's row of the prefill bench: its records against the baseline's (target-only,
    full prefill) on the same long prompts."""
    pairs = list(zip(records, base))
    same_number = []
    for r, b in pairs:
        ours = last_number(tok.decode(r["new_tokens"]))
        theirs = last_number(tok.decode(b["new_tokens"]))
        same_number.append(float(ours == theirs))
    prefilled = [r.get("prompt_tokens_prefilled", x.shape[1]) for r, x in zip(records, ids)]
    ttft = figures.nanmean(r["time_prefill"] for r in records)
    decode_base = per_token(base, "decode_time", "decode_tokens")
    e2e_base = per_token(base, "time_total", "num_new_tokens")
    return {
        "same_answer": figures.nanmean(float(r["new_tokens"] == b["new_tokens"]) for r, b in pairs),
        "same_number": figures.nanmean(same_number),
        "ttft_s": ttft,
        "ttft_speedup": figures.nanmean(b["time_prefill"] for b in base) / ttft,
        "decode_speedup": decode_base / per_token(records, "decode_time", "decode_tokens"),
        "e2e_speedup": e2e_base / per_token(records, "time_total", "num_new_tokens"),
        "prompt_tokens": figures.nanmean(x.shape[1] for x in ids),
        "prompt_tokens_prefilled": figures.nanmean(prefilled),
        "tau": figures.nanmean(r["tau"] for r in records),
    }


# ---------------------------------------------------------------------------------------------
# Table 1: batch 1, each mode beside target-only decoding


def table1(models, plan, run) -> dict:
    """plan.files: (path, field, prompts) of each prompt file, decoded target-only and in each
    of plan.modes. Greedy outputs that differ from target-only are classified by
    forensics.classify_divergence (run.tie_tolerance: a fixed tolerance in logits instead of
    tie_tolerance's). With plan.trace, the first prompt of the first file decoded once more in
    the first mode named, its trace written (decoding.write_trace)."""
    datasets = decoding.encode_files(models, plan)
    every_mode = ["target"] + plan.modes
    every_prompt = [x for _, _, ids in datasets.values() for x in ids]
    caches = decoding.prepare(models, run, every_prompt, every_mode)
    first = every_prompt[0]
    # warm-up
    decoding.decode_prompt(models, first, every_mode, run, caches, max_new_tokens=16)
    results = {}
    mismatches = []
    everything = collections.defaultdict(list)
    for name, (path, field, prompts) in datasets.items():
        records = collections.defaultdict(list)
        bar = tqdm(prompts, desc=name, unit="prompt", dynamic_ncols=True)
        for i, ids in enumerate(bar):
            decoded = decoding.decode_prompt(models, ids, every_mode, run, caches)
            for mode, r in decoded.items():
                records[mode].append(r)
            outputs = {m: [r["new_tokens"]] for m, r in decoded.items()}
            mismatches += find_divergences(models, [ids], outputs, run, i, dataset=name)
        results[name] = {"path": path, "field": field, "num_prompts": len(prompts)}
        results[name] |= dataset_cells(records, mismatches, name)
        for m in records:
            everything[m] += records[m]
    result = table1_figures(models, results, everything, mismatches, plan.modes, run)
    if plan.trace:
        decoding.write_trace(models, first, plan.modes[0], run, caches, plan.trace)
    return result


def dataset_cells(records: dict, mismatches: list[dict], name: str) -> dict:
    """One prompt file's row of Table 1: each mode's figures and mismatches, and its records
    per prompt (the new tokens left out)."""
    cells = {}
    per_prompt = {}
    for m in records:
        found = [x for x in mismatches if x["dataset"] == name and x["mode"] == m]
        cells[m] = figures.summarise(records[m], records["target"])
        cells[m]["mismatches"] = len(found)
        cells[m]["errors"] = sum(x["class"] == "error" for x in found)
        # each record without its new tokens
        per_prompt[m] = [{k: v for k, v in r.items() if k != "new_tokens"} for r in records[m]]
    return {"modes": cells, "per_prompt": per_prompt}


def table1_figures(models, results, everything, mismatches, modes, run) -> dict:
    """Table 1 printed, with the greedy check, and returned with its figures."""
    block_size = models.block_size(run.config)
    overall = {m: figures.summarise(everything[m], everything["target"]) for m in everything}
    text = figures.table(results, overall, modes, block_size)
    checked = sum(len(everything[m]) for m in modes)
    tally = report(text, mismatches, checked, run)
    result = {
        "datasets": results,
        "mean": {m: figures.mean_over_datasets(results, m) for m in modes},
        "overall": overall,
        "block_size": block_size,
        "table": text,
        "mismatches": tally,
    }
    if "hf" in overall:
        # > 1: this repo's target-only loop is faster than transformers' generate
        ratio = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
        result["target_vs_hf"] = ratio
    return result


# ---------------------------------------------------------------------------------------------
# The demo's comparison of its modes


def print_summary(models, records: dict, plan, run) -> dict:
    """The demo's table: target-only decoding, the plan's mode and its `compare` modes, each
    with its speed, speedup, tau, hit rate and whether its tokens are target-only's; without
    --mode, which mode the answers used and why. Returns {mode: figures.summarise}."""
    modes = list(dict.fromkeys(["target", plan.mode, *plan.compare]))
    info = models.info
    num_prompts = len(records["target"])
    block_size = models.block_size(run.config)
    print(
        f"\n{num_prompts} prompt(s), {info['device']}, {info['dtype']}, block size "
        f"{block_size}; tok/s with prefill excluded, speedup = target-only time per output "
        "token / the mode's, τ = the mean of per-prompt means"
    )
    header = f"{'mode':<8}{'tok/s':>8}{'speedup':>9}{'τ':>6}{'hit rate':>10}"
    print(header + "   same tokens as target-only")
    summaries = {}
    for m in modes:
        s = figures.summarise(records[m], records["target"])
        summaries[m] = s
        same = "-"
        tau = "-"
        if m != "target":
            pairs = zip(records[m], records["target"])
            same = sum(r["new_tokens"] == b["new_tokens"] for r, b in pairs)
            same = f"{same}/{num_prompts}"
            tau = f"{s['tau']:.2f}"
        if run.config.temperature and m != "target":
            same = "sampled"
        hit_rate = figures.or_dash(s.get("hit_rate"), ".0%")
        print(f"{m:<8}{s['tokens_per_s']:8.0f}{s['speedup']:8.2f}×{tau:>6}{hit_rate:>10}   {same}")
    if "async" in modes:
        lanes = records["async"][0]["lanes"]
        where = "after"
        if lanes == 2:
            where = "beside"
        print(
            f"async: the packed pass ran {where} the verification ({lanes} "
            f"lane{'s' * (lanes == 2)}); its hit rate is how often the next draft was ready "
            "when the verification ended"
        )
    if plan.why is not None and plan.compare:
        shown = [m for m in ("sync", "async") if m in summaries]
        speedups = ", ".join(f"{m} {summaries[m]['speedup']:.2f}x" for m in shown)
        print(
            f"the answers above used {plan.mode}, the mode a run takes without --mode: "
            f"{plan.why}; this table's speedups: {speedups}"
        )
    return summaries


def histogram(counts: dict[int, int], width: int = 40) -> str:
    """One bar per round length that occurred ({length: rounds}, figures.summarise's
    histogram; lengths with no round are left out)."""
    top = max(counts.values(), default=1)
    total = max(sum(counts.values()), 1)
    lines = []
    for n in sorted(counts):
        bar = "#" * math.ceil(width * counts[n] / top)
        lines.append(f"  {n:>3} | {bar:<{width}} {counts[n]:>5} ({counts[n] / total:.0%})")
    return "\n".join(lines)
