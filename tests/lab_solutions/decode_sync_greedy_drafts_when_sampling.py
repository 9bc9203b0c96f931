"""_decode_sync, wrong: the draft is the drafter's argmax even when sampling, while q is its
law at the sampling temperature: accept_draft's rule assumes d_i was drawn from q, so the
tokens leave the target's law (greedy decoding is untouched).
"""

EXERCISE = "decode_sync"
RULE = "pick"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_sync_sampling_follows_the_target_at_each_temperature",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        _, q_draft = sampler.pick(draft_logits)
        draft = draft_logits.argmax(-1)  # the bug: not drawn from q
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
