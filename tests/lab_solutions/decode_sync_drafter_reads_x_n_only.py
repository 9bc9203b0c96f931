"""_decode_sync, wrong: the drafter is given x_n alone each round, not every committed token it
has not read: after a round that accepted d_1 .. d_a, the tokens before x_n never reach its
cache, which then holds fewer tokens than are committed, and its blocks are drafted off a
text with holes.
"""

EXERCISE = "decode_sync"
RULE = "unread"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_drafter_cache_holds_the_committed_tokens_each_pass_assumes",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[-1:]], device=dc.device)  # the bug
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, tokens = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(tokens[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, tokens, block_size, (num_accepted, next_token))
