"""select_segment, wrong: a rejection at a covered position a + 1 selects its first branch
whatever token the target said: a branch prepared for another token t is reused, its block
drafted off a prefix that was not committed.
"""

EXERCISE = "select_segment"
RULE = "token"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for",)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    fanout = 0
    if candidates:
        fanout = len(candidates[0])
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and num_accepted < num_real:
            return place * fanout  # the bug: t is not looked at
    if num_accepted == num_real and guess == next_token:
        return len(covered) * fanout
    return -1
