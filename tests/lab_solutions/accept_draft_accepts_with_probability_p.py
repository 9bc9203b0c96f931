"""accept_draft, wrong: d_i is accepted with probability p(d_i) (u <= p), not min(1, p(d_i)
/ q(d_i)): a token the drafter proposes often is accepted as often as a rare one, so the
tokens the drafter likes come out too often.
"""

EXERCISE = "accept_draft"
RULE = "accept"  # the rule it breaks (lab.RULES)
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
    u = sampler.uniform((block_size,), p_d.device)
    accepts = (u <= p_d) & real  # the bug: q left out
    num_accepted = accepts.long().cumprod(0).sum()
    p_next = _at(p_target, num_accepted)
    q_next = _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    next_dist = torch.where(real.sum() == num_accepted, p_next, residual)
    return num_accepted, sampler.draw(next_dist / next_dist.sum())
