"""accept_draft, wrong: greedy acceptance counts every draft token equal to the target's
argmax, not only the unbroken prefix (a sum where a cumulative product belongs), so tokens
after the first mismatch are committed and the output leaves the target's.
"""

EXERCISE = "accept_draft"
RULE = "greedy"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (  # the tests that must fail (others may too)
    "test_greedy_acceptance_takes_the_longest_agreeing_prefix_then_the_targets_token",
    "test_sync_equals_target_greedy",
)


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    limit = block_size if num_real is None else num_real
    real = torch.arange(block_size, device=draft.device) < limit
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)
        num_accepted = ((draft == target_tokens[:block_size]) & real).long().sum()  # the bug
        return num_accepted, _at(target_tokens, num_accepted)
    p_target = sampler.probs(p_logits)
    rows = torch.arange(block_size, device=draft.device)
    p_d, q_d = p_target[rows, draft], q_draft[rows, draft]
    u = sampler.uniform((block_size,), p_d.device)
    num_accepted = ((u * q_d <= p_d) & real).long().cumprod(0).sum()
    p_next = _at(p_target, num_accepted)
    residual = (p_next - _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    law = torch.where(real.sum() == num_accepted, p_next, residual)
    return num_accepted, sampler.draw(law / law.sum())
