"""accept_draft, wrong: t is picked with index_select and kept as it comes, a tensor of
shape (1,), not a 0-d tensor. The round's read then gives t as a list [t], and the output
gets a list where a token belongs.
"""

EXERCISE = "accept_draft"
RULE = "returns"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_greedy_acceptance_takes_the_longest_agreeing_prefix_then_the_targets_token",)


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    if num_real is None:
        num_real = block_size
    real = torch.arange(block_size, device=draft.device) < num_real
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)
        agrees = (draft == target_tokens[:block_size]) & real
        num_accepted = agrees.long().cumprod(0).sum()
        # the bug: (1,), not 0-d
        return num_accepted, target_tokens.index_select(0, num_accepted.view(1))
    p_target = sampler.probs(p_logits)
    block_index = torch.arange(block_size, device=draft.device)
    p_d = p_target[block_index, draft]
    q_d = q_draft[block_index, draft]
    u = sampler.uniform((block_size,), p_d.device)
    accepts = (u * q_d <= p_d) & real
    num_accepted = accepts.long().cumprod(0).sum()
    p_next = _at(p_target, num_accepted)
    q_next = _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    next_dist = torch.where(real.sum() == num_accepted, p_next, residual)
    return num_accepted, sampler.draw(next_dist / next_dist.sum())
