"""select_segment, wrong: a guess of -1 is taken for "no guess to check", so full acceptance
matches whenever a = R. At B = 1 (where bonus_guess gives -1) that selects a segment with no
row left to be the next draft: the next round's draft has no real token (R = 0), and with
F = 2 its packed pass cannot be built (build_branch_pass raises: the grade points back here).
"""

EXERCISE = "select_segment"
RIGHT = False
FAILS = (  # tests that must fail (others may too)
    "test_full_acceptance_is_never_selected_at_b_1",
    "test_async_equals_sync_and_target",
)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    at_position = covered[:, None] == num_accepted + 1
    branch = (at_position & (candidates == next_token)).flatten()
    guessed = (guess == next_token) | (guess < 0)  # the bug: -1 matches every t
    full_match = (num_accepted == num_real) & guessed
    matches = torch.cat([branch, full_match[None]])
    first = (matches.long().cumsum(0) == 0).sum()
    return torch.where(first < len(matches), first, -1)
