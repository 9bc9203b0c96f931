"""select_segment, right, written another way: the outcome's segment index is computed from
the flat index of the branch (i, t) as a weight: every segment gets a score, 0 where it does
not match and S - index where it does, and the largest score names the first match.
"""

EXERCISE = "select_segment"
RIGHT = True
FAILS = ()  # tests that must fail: none


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    is_position = (covered == num_accepted + 1)[:, None]  # (C, 1)
    branch = (is_position & (candidates == next_token)).reshape(-1)  # (C*F,)
    full = ((num_accepted == num_real) & (guess == next_token)).reshape(1)
    matches = torch.cat([branch, full])  # (S,)
    num_segments = matches.shape[0]
    order = torch.arange(num_segments, 0, -1, device=matches.device)  # S .. 1
    score = matches.long() * order
    best = score.argmax()
    return torch.where(score.max() > 0, best, torch.full_like(best, -1))
