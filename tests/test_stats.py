"""The stats a decode returns, against their lists: runtime.Output.stats's docstring for
d3d.generate, systems.batched.generate's for a batch. A key the code adds without a line there,
or a line left for a key the code no longer returns, fails here.

Run: python -m pytest -q tests/test_stats.py
"""

import inspect
import re

import pytest
import torch

import d3d
import runtime
from systems import batched
from test_d3d import tiny_qwen3

torch.set_num_threads(1)

# a documented key: four spaces in, the key, then at least two spaces before its line
KEY_LINE = re.compile(r"^    ([a-z_<>]+)  ", re.MULTILINE)


def documented(function) -> set[str]:
    """The keys a docstring lists, one a line."""
    return set(KEY_LINE.findall(inspect.getdoc(function)))


def matches(key: str, documented_keys: set[str]) -> bool:
    """Whether `key` is one of the documented keys; time_<phase>_launch stands for every
    phase."""
    for name in documented_keys:
        pattern = re.escape(name).replace("<phase>", "[a-z_]+")
        if re.fullmatch(pattern, key):
            return True
    return False


@pytest.fixture(scope="module")
def drafter(tok):
    return d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)


def test_every_stats_key_of_generate_is_listed_in_output_stats(target, drafter):
    listed = documented(runtime.Output.stats)
    assert {"tau", "hits_per_position", "trace", "time_<phase>_launch"} <= listed, listed
    prompt = torch.arange(3, 23)[None]  # 20 tokens: five chunks of 4 for selective prefill
    runs = {
        "target": {"mode": "target"},
        "sync": {"mode": "sync"},
        "async": {"mode": "async"},
        "async, keep_ratio, trace": {
            "mode": "async",
            "keep_ratio": 0.5,
            "chunk_size": 4,
            "trace": True,
        },
    }
    returned = set()
    for name, kwargs in runs.items():
        _, stats = d3d.generate(target, drafter, prompt, max_new_tokens=8, **kwargs)
        unlisted = [key for key in stats if not matches(key, listed)]
        assert not unlisted, (
            f"{name}: stats keys {unlisted} have no line in runtime.Output.stats's docstring"
        )
        returned |= set(stats)
    # time_<phase>_launch: on CUDA alone
    never = [key for key in listed if "<" not in key and key not in returned]
    assert not never, f"runtime.Output.stats's docstring lists {never}, which no decode returns"


def test_every_stats_key_of_a_batch_is_listed_in_batched_generate(target, drafter):
    listed = documented(batched.generate)
    prompts = [torch.arange(3, 8), torch.arange(10, 19)]
    _, stats = batched.generate(target, drafter, prompts, max_new_tokens=6, mode="sync")
    unlisted = sorted(set(stats) - listed)
    never = sorted(listed - set(stats))
    assert not unlisted, f"stats keys {unlisted} have no line in batched.generate's docstring"
    assert not never, f"batched.generate's docstring lists {never}, which it does not return"
    doc = inspect.getdoc(batched.generate)
    rows_line = doc[doc.index("rows  ") :]
    for key in stats["rows"][0]:
        assert re.search(rf"\b{key}\b", rows_line), f"a row's {key} is not in the rows line"


@pytest.mark.parametrize(
    "block_size,settings,budget",
    [
        # the paper's budget at B = 16: C = 12, F = 2
        (16, {}, (12, 2)),
        # C = 0.75 B: 3 at B = 4, F = 2
        (4, {}, (3, 2)),
        (4, {"coverage": 1}, (1, 2)),
        (4, {"fanout": 3}, (3, 3)),
        (4, {"coverage": 0, "fanout": 1}, (0, 1)),
    ],
)
def test_async_stats_carry_the_branch_budget_the_decode_used(
    tok, target, block_size, settings, budget
):
    """stats["coverage"] and stats["fanout"] are the C and F the rounds branched with: the
    defaults resolved at the drafter's B where none is given, else the ones given."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=block_size)
    prompt = torch.arange(3, 9)[None]
    _, stats = d3d.generate(target, drafter, prompt, max_new_tokens=6, mode="async", **settings)
    assert (stats["coverage"], stats["fanout"]) == budget, stats
