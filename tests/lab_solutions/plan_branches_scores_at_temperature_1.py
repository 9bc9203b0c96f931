"""first_rejection_chance, wrong: q is the drafter's softmax at temperature 1 whatever
the sampling temperature. Sampling at T = 0.25 draws from a far sharper q than the one scored,
and the branches go where rejections are not.
"""

EXERCISE = "plan_branches"
RULE = "temperature"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_likely_cover_scores_at_the_sampling_temperature_and_at_1_when_greedy",)


def first_rejection_chance(draft_logits, draft, num_real: int, temperature: float):
    probs = torch.softmax(draft_logits.float(), -1)  # the bug: always at 1
    q_d = probs.gather(1, draft[:, None])[:, 0]
    reach = torch.cat([torch.ones_like(q_d[:1]), torch.cumprod(q_d, 0)[:-1]])
    rho = reach * (1 - q_d)
    rho[num_real:] = float("-inf")
    return rho
