"""first_rejection_chance, wrong: the pad's chance is 0 ("never rejected"), not -inf.
A real position whose q(d_i) rounds to 1 also scores 0, and the top C may then take the pad,
which can never be rejected, in its place.
"""

EXERCISE = "plan_branches"
RULE = "pad"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_first_rejection_chance_is_rho_with_q_at_the_scoring_temperature",)


def first_rejection_chance(draft_logits, draft, num_real: int, temperature: float):
    scoring_temperature = temperature
    if temperature == 0:
        scoring_temperature = 1.0
    probs = torch.softmax(draft_logits.float() / scoring_temperature, -1)
    q_d = probs.gather(1, draft[:, None])[:, 0]
    reach = torch.cat([torch.ones_like(q_d[:1]), torch.cumprod(q_d, 0)[:-1]])
    rho = reach * (1 - q_d)
    rho[num_real:] = 0.0  # the bug: 0, not -inf
    return rho
