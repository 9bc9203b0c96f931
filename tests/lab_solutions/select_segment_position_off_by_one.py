"""select_segment, wrong: the branch for the outcome is looked up at i = a, not i = a + 1 (the
accepted count taken for the rejected position). A branch prepared for "d_a rejected" is
reused after d_a was accepted: its block was drafted off another prefix.
"""

EXERCISE = "select_segment"
RULE = "position"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for",)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = len(candidates[0]) if candidates else 0
    for place, position in enumerate(covered):
        if position == num_accepted and next_token in candidates[place]:  # the bug: i = a
            return place * fanout + candidates[place].index(next_token)
    if num_accepted == num_real and guess == next_token:
        return len(covered) * fanout
    return -1
