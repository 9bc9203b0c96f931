"""_decode_sync, wrong: the drafter is given every committed token each round, not only those
it has not read: its cache, which already holds them, gets them again after what it holds,
and its blocks are drafted off a text that repeats itself.
"""

EXERCISE = "decode_sync"
RULE = "drafter-cache"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_drafter_cache_holds_the_committed_tokens_each_pass_assumes",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens], device=dc.device)  # the bug: all of them
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
