"""select_segment, wrong: a guess of -1 is taken for "no guess to check", so full acceptance
matches whenever a = R. At B = 1 (where bonus_guess gives -1) that selects a segment with no
row left to be the next draft: the next round's draft has no real token (R = 0), and with
F = 2 its packed pass cannot be built (build_branch_pass raises: the grade points back here).
"""

EXERCISE = "select_segment"
RULE = "b-1"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (  # the tests that must fail (others may too)
    "test_full_acceptance_is_never_selected_at_b_1",
    "test_async_equals_sync_and_target",
)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = len(candidates[0]) if candidates else 0
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and next_token in candidates[place]:
            return place * fanout + candidates[place].index(next_token)
    guessed = guess == next_token or guess < 0  # the bug: -1 matches every t
    if num_accepted == num_real and guessed:
        return len(covered) * fanout
    return -1
