"""select_segment, wrong: the branches are numbered candidate by candidate (each candidate's
place first, then the position: place * C + c), not position by position: where F > 1 a hit
reuses the block prepared for another outcome.
"""

EXERCISE = "select_segment"
RULE = "order"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for",)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = 0
    if candidates:
        fanout = len(candidates[0])
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and next_token in candidates[place]:
            # the bug: candidate-major
            return candidates[place].index(next_token) * len(covered) + place
    if num_accepted == num_real and guess == next_token:
        return len(covered) * fanout
    return -1
