"""select_segment, wrong: a miss returns None, not -1: the loop's `segment >= 0` cannot
compare None with an int.
"""

EXERCISE = "select_segment"
RULE = "miss"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for",)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = 0
    if candidates:
        fanout = len(candidates[0])
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and next_token in candidates[place]:
            return place * fanout + candidates[place].index(next_token)
    if num_accepted == num_real and guess == next_token:
        return len(covered) * fanout
    return None  # the bug: not -1
