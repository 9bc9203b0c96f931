"""select_segment, wrong: full acceptance is checked before the branches: where C covers the
pad and both match, the block of B - 1 real tokens and a pad is chosen over the branch's B
real tokens.
"""

EXERCISE = "select_segment"
RULE = "branch-first"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_branch_at_the_pad_is_selected_before_full_acceptance",)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = 0
    if candidates:
        fanout = len(candidates[0])
    if num_accepted == num_real and guess == next_token:  # the bug: before the branches
        return len(covered) * fanout
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and next_token in candidates[place]:
            return place * fanout + candidates[place].index(next_token)
    return -1
