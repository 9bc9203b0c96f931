"""select_segment, right, written another way: every prepared outcome (i, t) is listed in the
order of the segments, full acceptance last as (R + 1, g), and the outcome (a + 1, t) is looked
up in that list; its first place is the segment.
"""

EXERCISE = "select_segment"
RIGHT = True
FAILS = ()  # tests that must fail: none


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    outcomes = []
    for position, tokens in zip(covered, candidates):
        outcomes += [(position, token) for token in tokens]
    full_acceptance = (num_real + 1, guess)
    outcomes.append(full_acceptance)
    outcome = (num_accepted + 1, next_token)
    if outcome not in outcomes:
        return -1
    return outcomes.index(outcome)
