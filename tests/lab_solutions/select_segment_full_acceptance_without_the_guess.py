"""select_segment, wrong: full acceptance is selected whenever all R tokens are accepted,
whatever bonus token the target said: its block was drafted after its guess g, so where
t differs it is reused after a token that was not committed.
"""

EXERCISE = "select_segment"
RULE = "guess"  # the rule it breaks (lab.RULES)
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
    if num_accepted == num_real and guess >= 0:  # the bug: t is not compared with g
        return len(covered) * fanout
    return -1
