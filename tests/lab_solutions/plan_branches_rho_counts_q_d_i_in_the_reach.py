"""first_rejection_chance, wrong: the cumulative product is not shifted, so q(d_i) is in
its own reach: rho_i = q(d_1) .. q(d_i) (1 - q(d_i)), the chance that d_i is accepted and
rejected at once. Confident positions then look least likely to fail, whatever came before.
"""

EXERCISE = "plan_branches"
RULE = "rho"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = (
    "test_first_rejection_chance_is_rho_with_q_at_the_scoring_temperature",
    "test_likely_cover_ranks_positions_by_the_chance_the_first_rejection_is_there",
)


def first_rejection_chance(draft_logits, draft, num_real: int, temperature: float):
    scoring_temperature = temperature
    if temperature == 0:
        scoring_temperature = 1.0
    probs = torch.softmax(draft_logits.float() / scoring_temperature, -1)
    q_d = probs.gather(1, draft[:, None])[:, 0]
    reach = torch.cumprod(q_d, 0)  # the bug: not shifted by one
    rho = reach * (1 - q_d)
    rho[num_real:] = float("-inf")
    return rho
