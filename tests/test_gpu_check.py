"""Tests for tests/gpu_check.py, on the CPU: the --tiny check passes and writes what it says, and a
check that fails makes its step FAILED and the script's exit non-zero.

Run: python -m pytest -q tests/test_gpu_check.py
"""

import json
import os
import re
import runpy
import subprocess
import sys

from project_files import project_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "tests", "gpu_check.py")
STEPS = runpy.run_path(CHECK)["STEPS"]  # n: (name, --tiny time limit, limit without --tiny)
SLACK = 120  # seconds beyond the steps' limits: the parent's start, each step's file written


def run_check(out, *args, steps=tuple(STEPS), env=None):
    """gpu_check.py --tiny on `steps`, under a time limit that each step's own limit fits in, one
    after the other: a step that hangs fails as the script says, not as this call's timeout."""
    return subprocess.run(
        [sys.executable, CHECK, "--tiny", str(out), "--steps", *map(str, steps), *args],
        capture_output=True,
        text=True,
        timeout=sum(STEPS[n][1] for n in steps) + SLACK,
        cwd=ROOT,
        env=env,
    )


def test_tiny_check_passes_and_writes_each_step_and_the_trace(tmp_path):
    """Every step's file starts with its status (the CUDA-only parts skipped, each with its reason),
    the summary lists them all, and the trace of async rounds holds each lane's spans on its own
    track."""
    run = run_check(tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    statuses = {}
    for n, name in (
        (0, "environment"),
        (1, "passes"),
        (2, "shared-pool"),
        (3, "compiled-path"),
        (4, "sanitizer"),
    ):
        first = (tmp_path / f"{n}-{name}.txt").read_text().splitlines()[0]
        statuses[n] = first.split(": ", 1)[1].split(" ")[0]
        assert first in run.stdout  # what it prints is what it wrote
    assert statuses == {0: "PASSED", 1: "PASSED", 2: "SKIPPED", 3: "PASSED", 4: "SKIPPED"}
    assert "skip   one graph pool for two streams: graph pools and streams need CUDA" in run.stdout
    step3 = (tmp_path / "3-compiled-path.txt").read_text()
    for check in (
        "no recompile after the warm-up",
        "rejection branches and the full-acceptance block both hit",
        "two compiled lanes decode the same tokens as one",
    ):
        assert f"ok     {check}" in step3
    assert "5 steps, 0 failed" in (tmp_path / "summary.txt").read_text()
    trace = json.loads((tmp_path / "trace-async.json").read_text())
    tracks = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    on = {
        key: {tracks[e["tid"]] for e in trace["traceEvents"] if e["name"] == key}
        for key in ("verify", "packed_draft")
    }
    assert on == {"verify": {"thread MainThread"}, "packed_draft": {"thread packed-pass_0"}}


def test_a_failing_check_fails_its_step_and_the_exit(tmp_path):
    """A bug planted in the project (acceptance takes one draft token too many) reaches step [3]'s
    check that compiled decoding equals target-only: the step's file says FAILED, the exit is
    non-zero."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        "import torch\nimport d3d\n_accept = d3d.accept_draft\n\n\n"
        "def one_too_many(p_logits, draft, *args, **kwargs):\n"
        "    num_accepted, next_token = _accept(p_logits, draft, *args, **kwargs)\n"
        "    return torch.clamp(num_accepted + 1, max=draft.shape[0]), next_token\n\n\n"
        "d3d.accept_draft = one_too_many\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(plant), ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    run = run_check(tmp_path / "out", steps=[3], env=env)
    assert run.returncode != 0
    step3 = (tmp_path / "out" / "3-compiled-path.txt").read_text()
    assert step3.startswith("[3] compiled-path: FAILED")
    assert "FAILED compiled sync equals eager target-only or differs at near-ties" in step3
    assert "1 steps, 1 failed" in (tmp_path / "out" / "summary.txt").read_text()


def test_the_sanitizer_step_selects_every_test_that_needs_cuda():
    """Step [4]'s selection, collected here on the CPU, is not empty: every test function of
    tests/test_cuda.py but the training step. And no other test file skips for want of CUDA, so
    that selection holds every CUDA test of the suite."""
    selection = runpy.run_path(CHECK)["SANITIZER_TESTS"]
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", *selection]
    run = subprocess.run(collect, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    selected = {
        line.split("::")[1].split("[")[0] for line in run.stdout.splitlines() if "::" in line
    }
    with open(os.path.join(ROOT, "tests", "test_cuda.py"), encoding="utf-8") as f:
        defined = set(re.findall(r"^def (test_\w+)", f.read(), re.M))
    assert selected and selected == defined - {"test_cuda_training_step_at_qwen3_shapes_fits"}
    skips_for_cuda = re.compile(r"skip\w*\((?:[^()]|\([^()]*\))*cuda", re.S | re.I)
    others = [
        path
        for path in project_files(".py")
        if path == "test_d3d.py" or re.fullmatch(r"tests/test_\w+\.py", path)
    ]
    assert "test_d3d.py" in others and "tests/test_gpu_check.py" in others, others
    for path in others:
        if path == "tests/test_cuda.py":
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        # a test of what a machine without CUDA says skips where there is CUDA: not a CUDA test
        where_cuda = "skip" + "if(torch.cuda.is_available(),"
        for skip in skips_for_cuda.finditer(text):
            call = text[skip.start() : skip.start() + len(where_cuda)]
            assert call == where_cuda, f"{path}: {text[skip.start() : skip.end() + 40]}"
