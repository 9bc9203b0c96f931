"""The worked async trace in d3d.py (tests/worked_trace.py): it is what the code prints today,
and each of its rounds does what the method says it must, checked against numbers worked out by
hand.

Run: python -m pytest -q tests/test_trace.py
"""

import difflib

import pytest
import torch
import worked_trace

import d3d

B = 4  # the scenario's block size; C = 2, F = 1: segments (1, t) (2, t) (L + 1, g)
P = 5  # prompt x_0 .. x_4; the prefill's token is x_5, so round 0 starts at n = 5


@pytest.fixture(scope="module")
def trace():
    torch.set_num_threads(1)
    return worked_trace.run_trace()


def test_the_trace_in_d3d_py_is_the_code_s(trace):
    written = worked_trace.written_trace()
    wanted = worked_trace.as_comments(worked_trace.trace_text())
    diff = "".join(difflib.unified_diff(written, wanted, "d3d.py", "tests/worked_trace.py"))
    assert written == wanted, (
        "the worked trace in d3d.py is stale: run python tests/worked_trace.py --write\n" + diff
    )


def test_the_trace_does_not_depend_on_the_float_order():
    texts = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        texts.append(worked_trace.trace_text())
    torch.set_num_threads(1)
    assert texts[0] == texts[1], "the worked trace changed with the thread count: a near-tie"


# What each round must do, worked out by hand from the method and the script (the drafter is right
# everywhere except x_7, where its runner-up is right, and x_10, where both choices are wrong).
# After a round that starts at x_n and accepts a tokens, the output holds x_0 .. x_{n+a+1}; the
# target's cache holds x_0 .. x_{n+a} (n + a + 1 tokens; x_{n+a+1} goes with the next draft); the
# drafter's holds x_0 .. x_n and d_1 .. d_a (n + 1 + a tokens): the same tokens.


def test_round_0_uses_the_rejection_branch(trace):
    rounds, _, x = trace
    info = rounds[0]
    # draft x_6 .. x_9 from a draft pass: x_6 right, x_7 wrong -> a = 1, t = x_7
    assert (info.n, info.drafted_by, info.num_real) == (5, "draft pass", B)
    assert (info.num_accepted, info.next_token) == (1, x[7])
    assert info.committed == [x[6], x[7]]
    # branch (i, t) = (2, x_7) is segment 1 (after (1, t)): a hit on it
    assert info.outcomes[1] == (2, x[7])
    assert info.segment == 1
    assert info.target_cache == (5, 7)  # x_0 .. x_4 -> x_0 .. x_6
    assert info.drafter_cache == (5, 7)  # x_0 .. x_4 -> x_0 .. x_5, d_1


def test_round_1_misses_beyond_the_coverage(trace):
    rounds, _, x = trace
    info = rounds[1]
    # the branch's block drafts x_8 .. x_11: x_8, x_9 right, x_10 wrong -> a = 2; k = 3 > C
    assert (info.n, info.drafted_by, info.num_real) == (7, "branch", B)
    assert info.draft[:2] == [x[8], x[9]]
    assert info.draft[2] != x[10]
    assert (info.num_accepted, info.next_token) == (2, x[10])
    assert info.committed == [x[8], x[9], x[10]]
    assert [k for k, _ in info.outcomes] == [1, 2, B + 1]
    assert info.segment == -1
    assert info.target_cache == (7, 10)
    assert info.drafter_cache == (7, 10)


def test_round_2_hits_the_full_acceptance_block(trace):
    rounds, _, x = trace
    info = rounds[2]
    # after the miss, a draft pass drafts x_11 .. x_14, all right; the bonus x_15 was guessed
    assert (info.n, info.drafted_by, info.num_real) == (10, "draft pass", B)
    assert info.draft == x[11:15]
    assert (info.num_accepted, info.next_token) == (B, x[15])
    assert info.committed == x[11:16]
    assert info.outcomes[2] == (B + 1, x[15])
    assert info.segment == 2  # the last segment: full acceptance
    assert info.target_cache == (10, 15)
    assert info.drafter_cache == (10, 15)


def test_round_3_drafts_b_minus_1_tokens_and_a_pad_never_accepted(trace):
    rounds, output, x = trace
    info = rounds[3]
    # the full-acceptance block's rows 2 .. 4 draft x_16 .. x_18; the fourth token is a pad
    assert (info.n, info.drafted_by) == (15, "full acceptance")
    assert info.num_real == B - 1
    assert len(info.draft) == B
    assert info.draft[:3] == x[16:19]
    assert (info.num_accepted, info.next_token) == (B - 1, x[19])  # the bonus, at the pad's row
    assert info.committed == x[16:20]
    assert info.outcomes[-1][0] == B  # full acceptance of L = 3 real tokens: k = L + 1
    assert info.target_cache == (15, 19)
    assert info.drafter_cache == (15, 19)
    assert len(rounds) == 4
    assert output == x[:20]  # the target's own greedy tokens, 15 new ones


def test_round_info_is_the_one_d3d_reports(trace):
    rounds, _, _ = trace
    assert all(isinstance(info, d3d.RoundInfo) for info in rounds)
    assert [info.index for info in rounds] == [0, 1, 2, 3]
    assert all(info.mode == "async" for info in rounds)
