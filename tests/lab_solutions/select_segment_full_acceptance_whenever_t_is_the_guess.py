"""select_segment, wrong: full acceptance is selected whenever t equals its guess g, whatever
a: after a rejection whose correction happens to be g, the block drafted after all R tokens
and g is reused after a shorter prefix.
"""

EXERCISE = "select_segment"
RULE = "full"  # the rule it breaks (lab.RULES)
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
    if guess == next_token:  # the bug: a is not looked at
        return len(covered) * fanout
    return -1
