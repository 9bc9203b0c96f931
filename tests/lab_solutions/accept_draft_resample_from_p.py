"""accept_draft, wrong: at a rejection the next token is drawn from the target's p, not from
the residual max(p - q, 0). Greedy decoding is untouched; sampling is no longer lossless, as
the tokens the drafter likes get two chances: once accepted, once more from p.
"""

EXERCISE = "accept_draft"
RULE = "residual"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_accept_rule_is_lossless",)


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    limit = block_size if num_real is None else num_real
    real = torch.arange(block_size, device=draft.device) < limit
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)
        num_accepted = ((draft == target_tokens[:block_size]) & real).long().cumprod(0).sum()
        return num_accepted, _at(target_tokens, num_accepted)
    p_target = sampler.probs(p_logits)
    rows = torch.arange(block_size, device=draft.device)
    p_d, q_d = p_target[rows, draft], q_draft[rows, draft]
    u = sampler.uniform((block_size,), p_d.device)
    num_accepted = ((u * q_d <= p_d) & real).long().cumprod(0).sum()
    p_next = _at(p_target, num_accepted)
    return num_accepted, sampler.draw(p_next)  # the bug: p, not max(p - q, 0)
