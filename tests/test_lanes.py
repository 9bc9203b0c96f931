"""Two lanes: the packed pass beside verification (a second CUDA stream, or a CPU thread).

Run: python -m pytest -q tests/test_lanes.py
"""

import json

import pytest
import torch

import d3d
import runtime
from systems import fast
from test_d3d import tiny_qwen3

torch.set_num_threads(1)


def test_two_lanes_on_a_cpu_decode_the_same_tokens(tok, target):
    """lanes=2 on a CPU: the packed pass in a worker thread beside verification; greedy output
    equals target-only, hits happen as with one lane, and torch's thread count comes back."""
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=40, mode="target")
    threads = torch.get_num_threads()
    one, one_stats = d3d.generate(target, drafter, prompt, max_new_tokens=40, mode="async", lanes=1)
    two, two_stats = d3d.generate(target, drafter, prompt, max_new_tokens=40, mode="async", lanes=2)
    assert one.tolist() == two.tolist() == expected.tolist()
    assert (
        one_stats["hits_per_position"] == two_stats["hits_per_position"] and two_stats["lanes"] == 2
    )
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="DecodeConfig.lanes must be int one of 1, 2, got 3"):
        d3d.generate(target, drafter, prompt, max_new_tokens=4, mode="async", lanes=3)


@pytest.mark.parametrize("lanes", [1, 2])
def test_two_cpu_lanes_run_both_passes_at_once(lanes):
    """With two lanes verification and the packed pass are in flight together: two callables that
    wait for each other at a barrier both get through; one after the other, the first waits alone
    and the barrier breaks."""
    import threading

    barrier = threading.Barrier(2, timeout=5 if lanes == 2 else 0.5)
    clock = runtime.Clock(torch.device("cpu"))

    def meet(value):
        def wait_then_give():
            barrier.wait()
            return torch.tensor(value)

        return wait_then_give

    with d3d._Overlap(torch.device("cpu"), lanes, clock) as overlap:
        if lanes == 2:
            verified, packed = overlap.both(meet(1), meet(2))
            assert (verified.item(), packed.item()) == (1, 2)
        else:
            with pytest.raises(threading.BrokenBarrierError):
                overlap.both(meet(1), meet(2))


@pytest.mark.parametrize("lanes", [1, 2])
def test_the_packed_pass_builds_no_autograd_graph_in_either_lane(lanes):
    """The decode runs under no_grad, which a worker thread does not inherit: the packed pass must
    not record a graph (its outputs and the drafter's cache would hold one, round after round)."""
    import threading

    weight, clock = torch.ones(3, requires_grad=True), runtime.Clock(torch.device("cpu"))
    threads = {}

    def run(key, factor):
        def times_weight():
            threads[key] = threading.current_thread().name
            return weight * factor

        return times_weight

    with d3d._Overlap(torch.device("cpu"), lanes, clock) as overlap:
        with torch.no_grad():
            verified, packed = overlap.both(run("verify", 2), run("packed", 3))
    assert not verified.requires_grad and not packed.requires_grad
    # two lanes: the worker ran it
    assert (threads["packed"] != threads["verify"]) == (lanes == 2)


def test_the_lanes_rule_refuses_two_compiled_lanes_on_cuda():
    """runtime.async_lanes, a pure function of (device type, compiled, lanes[, target size]): two
    lanes with compiled passes on CUDA are refused with the ways out named; everything else passes
    or gets the default."""
    with pytest.raises(
        ValueError, match=r"refused.*CUDA graphs share one memory pool.*lanes=1.*eager passes"
    ):
        runtime.async_lanes("cuda", True, 2)
    # compiled: one lane
    assert runtime.async_lanes("cuda", True, 1) == runtime.async_lanes("cuda", True) == 1
    # eager: allowed
    assert runtime.async_lanes("cuda", False, 2) == 2 and runtime.async_lanes("cuda", False) == 1
    assert runtime.async_lanes("cpu", True, 2) == 2  # a CPU has no graph pool to share
    assert runtime.async_lanes("cpu", False, None, runtime.TWO_LANES_MIN_PARAMS) == 2
    assert runtime.async_lanes("cpu", False, None, runtime.TWO_LANES_MIN_PARAMS - 1) == 1
    for bad in (0, 3):
        with pytest.raises(ValueError, match="lanes must be 1"):
            runtime.async_lanes("cpu", False, bad)
    with runtime.unproven_compiled_lanes():  # tests/gpu_check.py's comparison of two lanes with one
        assert runtime.async_lanes("cuda", True, 2) == 2
    with pytest.raises(ValueError, match="refused"):  # and only inside
        runtime.async_lanes("cuda", True, 2)


def test_generate_takes_lanes_from_the_rule_with_its_caches_compiled_or_not(
    tok, target, monkeypatch
):
    """generate(lanes=None) asks runtime.async_lanes, telling it whether its caches are compiled:
    seen as a CUDA device here, async with compiled caches and two lanes is refused, one lane or
    eager caches decode; sync has no lanes to refuse."""

    monkeypatch.setattr(d3d, "async_lanes", lambda _, *args: runtime.async_lanes("cuda", *args))
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=3)
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=12, mode="target")
    compiled = runtime.Caches.make(target, drafter, 64)
    fast.compile_passes(compiled, backend="eager")
    regional = runtime.Caches.make(target, drafter, 64)
    fast.compile_passes(regional, backend="eager", regional=True)
    assert (
        compiled.compiled
        and regional.compiled
        and not runtime.Caches.make(target, drafter, 64).compiled
    )
    with pytest.raises(ValueError, match="refused"):
        d3d.generate(
            target, drafter, prompt, max_new_tokens=12, mode="async", lanes=2, caches=compiled
        )
    for caches, lanes, mode in (
        (compiled, None, "async"),
        (compiled, 1, "async"),
        (None, 2, "async"),
        (compiled, 2, "sync"),
    ):
        out, stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=12, mode=mode, lanes=lanes, caches=caches
        )
        assert out.tolist() == expected.tolist() and stats.get("lanes", lanes) == (lanes or 1)


@pytest.mark.parametrize("lanes", [1, 2])
def test_trace_draws_each_lane_on_its_own_track(tok, target, lanes):
    """generate(trace=True): the phases as Chrome trace events, each on the track of the thread it
    ran on: with two lanes the packed pass on the worker's track, beside the verification on the
    main thread's; with one, all on the main thread, the packed pass after the verification in every
    round."""
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=3)
    _, stats = d3d.generate(
        target, drafter, prompt, max_new_tokens=20, mode="async", lanes=lanes, trace=True
    )
    events = stats["trace"]["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {
        key: [e for e in events if e["name"] == key] for key in ("verify", "packed_draft", "both")
    }
    assert (
        len(spans["verify"])
        == len(spans["packed_draft"])
        == len(spans["both"])
        == stats["num_rounds"]
        > 1
    )
    worker = "thread packed-pass_0" if lanes == 2 else "thread MainThread"
    assert {tracks[e["tid"]] for e in spans["packed_draft"]} == {worker}
    assert {tracks[e["tid"]] for e in spans["verify"] + spans["both"]} == {"thread MainThread"}
    for verify, packed, both in zip(
        *spans.values()
    ):  # both passes inside their round's "both" span
        assert both["ts"] <= min(verify["ts"], packed["ts"])
        assert (
            max(verify["ts"] + verify["dur"], packed["ts"] + packed["dur"])
            <= both["ts"] + both["dur"] + 1
        )
        if lanes == 1:
            assert verify["ts"] + verify["dur"] <= packed["ts"] + 1  # one after the other
    assert json.loads(json.dumps(stats["trace"])) == stats["trace"]
