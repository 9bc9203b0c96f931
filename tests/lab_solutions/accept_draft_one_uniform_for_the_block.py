"""accept_draft, wrong: one uniform u for the whole block, not one per d_i. Each d_i alone is
accepted at the right rate, but after a small u has accepted d_1 the same small u accepts d_2
too: acceptances come in runs, and the second token leaves the target's law.
"""

EXERCISE = "accept_draft"
RULE = "own-u"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_accept_rule_is_lossless",)


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    if num_real is None:
        num_real = block_size
    real = torch.arange(block_size, device=draft.device) < num_real
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)
        agrees = (draft == target_tokens[:block_size]) & real
        num_accepted = agrees.long().cumprod(0).sum()
        return num_accepted, _at(target_tokens, num_accepted)
    p_target = sampler.probs(p_logits)
    block_index = torch.arange(block_size, device=draft.device)
    p_d = p_target[block_index, draft]
    q_d = q_draft[block_index, draft]
    u = sampler.uniform((1,), p_d.device)  # the bug: one u for every d_i
    accepts = (u * q_d <= p_d) & real
    num_accepted = accepts.long().cumprod(0).sum()
    p_next = _at(p_target, num_accepted)
    q_next = _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    next_dist = torch.where(real.sum() == num_accepted, p_next, residual)
    return num_accepted, sampler.draw(next_dist / next_dist.sum())
