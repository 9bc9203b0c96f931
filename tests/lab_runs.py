"""The lab's exercises 1 to 5 on the shipped toy, under every float order this CPU offers, each with
several seeds: the runs behind LAB.md's ranges.

    python tests/lab_runs.py runs/lab-ranges        # 9 drafters x 2 seeds x each float order
    python tests/lab_runs.py runs/lab-ranges --orders native --seeds 0 --runs base lam0

Every run is `python train.py --seed S --threads 1 FLAGS --out OUT/ORDER/NAME-sS` with the float
order's environment; `--jobs` of them at a time (default 2, one per core of a 2-core machine). A run
whose train_args.json is there is not run again, so an interrupted sweep resumes. At the end it
prints each run's offline tau, then one range per outcome over all runs, and writes OUT/runs.json.

Float orders: `native` (torch's choice on this CPU), `avx2` (where the CPU has AVX-512:
ATEN_CPU_CAPABILITY=avx2 and the same cap for MKL and oneDNN), `sse` (a CPU without AVX:
ATEN_CPU_CAPABILITY=default, SSE4.2 / SSE4.1 caps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDERS = {
    "native": {},
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "sse": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}
# name: (LAB exercise, train.py flags); the slowest first, so that two workers finish together
RUNS = {
    "d4": ("5: all 4 layers", ["--drafter-layers", "4"]),
    "b16": ("4: B = 16", ["--block-size", "16"]),
    "d1": ("5: 1 layer", ["--drafter-layers", "1"]),
    "base": ("default: the first 2 layers, B = 8, K = 32, lambda = 1", []),
    "lam0": ("1: lambda = 0, d_1 from MASK 1", ["--ar-weight", "0", "--d1-from", "mask"]),
    "d03": ("5: layers 0 and 3", ["--drafter-layers", "0,3"]),
    "rand2": ("5: 2 layers from random weights", ["--random-init"]),
    "b4": ("4: B = 4", ["--block-size", "4"]),
    "k4": ("3: K = 4", ["--num-anchors", "4"]),
}


def available_orders() -> list[str]:
    """avx2 is a float order of its own only on a CPU with AVX-512 (elsewhere it is the native
    one)."""
    native = torch.backends.cpu.get_cpu_capability()
    return (
        ["native", "sse"] if native in ("AVX2", "DEFAULT", "NO AVX") else ["native", "avx2", "sse"]
    )


def run_one(out: str, order: str, name: str, seed: int, extra: list[str]) -> dict:
    folder = os.path.join(out, order, f"{name}-s{seed}")
    record = os.path.join(folder, "train_args.json")
    if not os.path.isfile(record):
        os.makedirs(folder, exist_ok=True)
        cmd = [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--seed",
            str(seed),
            "--threads",
            "1",
            *RUNS[name][1],
            *extra,
            "--out",
            folder,
        ]
        with open(os.path.join(folder, "log.txt"), "w") as log:
            t0 = time.monotonic()
            done = subprocess.run(
                cmd,
                cwd=ROOT,
                env={**os.environ, **ORDERS[order]},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.write(
                f"\n[lab_runs] {' '.join(cmd)}: exit {done.returncode} after "
                f"{time.monotonic() - t0:.0f} s\n"
            )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed (exit {done.returncode}): see {folder}/log.txt"
            )
    with open(record) as f:
        r = json.load(f)
    head, mask = (
        (r["offline_tau"], r["offline_tau_d1_from_mask"])
        if r["d1_from"] == "causal"
        else (r["offline_tau_d1_from_causal"], r["offline_tau"])
    )
    return {
        "order": order,
        "run": name,
        "seed": seed,
        "tau": r["offline_tau"],
        "tau_d1_head": head,
        "tau_d1_mask": mask,
        "train_seconds": r["train_seconds"],
        "folder": folder,
    }


def ranges(results: list[dict]) -> list[tuple[str, float, float, int]]:
    """(outcome, lowest, highest, runs) for each run name: tau with its own d_1 rule, and for the
    default and lambda = 0 the other rule too."""
    out = []
    for name in RUNS:
        rows = [r for r in results if r["run"] == name]
        if not rows:
            continue
        keys = ["tau"] + (
            ["tau_d1_mask"] if name == "base" else ["tau_d1_head"] if name == "lam0" else []
        )
        for key in keys:
            values = [r[key] for r in rows]
            out.append((f"{name} {key}", min(values), max(values), len(values)))
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the drafters, their logs and runs.json")
    ap.add_argument(
        "--orders",
        nargs="+",
        choices=list(ORDERS),
        help="float orders (default: all this CPU offers)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (default: 2)")
    ap.add_argument(
        "--extra", default="", help="more train.py flags for every run, e.g. '--steps 800'"
    )
    args = ap.parse_args(argv)
    orders = args.orders or available_orders()
    jobs = [(o, n, s) for n in args.runs for o in orders for s in args.seeds]
    print(
        f"[lab] {len(jobs)} runs ({', '.join(args.runs)} x float orders {', '.join(orders)} x "
        f"seeds {args.seeds}), {args.jobs} at a time, into {os.path.abspath(args.out)}"
    )
    results = []
    with (
        ThreadPoolExecutor(args.jobs) as pool,
        tqdm(total=len(jobs), desc="lab runs", unit="run") as bar,
    ):
        futures = [pool.submit(run_one, args.out, o, n, s, args.extra.split()) for o, n, s in jobs]
        for future in futures:
            results.append(future.result())
            bar.update(1)
    for r in results:
        print(
            f"{r['run']:>6} {r['order']:>6} seed {r['seed']}: tau {r['tau']:.2f} "
            f"(d_1 from the head {r['tau_d1_head']:.2f}, from MASK 1 {r['tau_d1_mask']:.2f}), "
            f"{r['train_seconds']:.0f} s"
        )
    print("outcome                 range over runs")
    for key, lo, hi, n in ranges(results):
        print(f"{key:<22} {lo:.2f} - {hi:.2f}  ({n} runs)")
    with open(os.path.join(args.out, "runs.json"), "w") as f:
        json.dump(
            {
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "orders": orders,
                "extra": args.extra,
                "runs": results,
            },
            f,
            indent=1,
        )
    print(f"[lab] wrote {os.path.join(os.path.abspath(args.out), 'runs.json')}")
    return results


if __name__ == "__main__":
    main()
