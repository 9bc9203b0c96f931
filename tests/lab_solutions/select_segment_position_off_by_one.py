"""select_segment, wrong: the branch for the outcome is looked up at i = a, not i = a + 1 (the
accepted count taken for the rejected position). A branch prepared for "d_a rejected" is
reused after d_a was accepted: its block was drafted off another prefix.
"""

EXERCISE = "select_segment"
RIGHT = False
FAILS = (  # tests that must fail (others may too)
    "test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for",
    "test_async_equals_sync_and_target",
)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    at_position = covered[:, None] == num_accepted  # the bug: i = a
    branch = (at_position & (candidates == next_token)).flatten()
    full_match = (num_accepted == num_real) & (guess == next_token)
    matches = torch.cat([branch, full_match[None]])
    first = (matches.long().cumsum(0) == 0).sum()
    return torch.where(first < len(matches), first, -1)
