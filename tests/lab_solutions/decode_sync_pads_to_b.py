"""_decode_sync, wrong: the drafter's causal tokens are padded to B, not B + 1: after a round
that accepted the whole block, B + 1 tokens are new and the pass is wider than the others,
so a compiled pass compiles a second graph.
"""

EXERCISE = "decode_sync"
RULE = "shape"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_every_sync_draft_pass_has_one_shape_whatever_the_round_read",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
