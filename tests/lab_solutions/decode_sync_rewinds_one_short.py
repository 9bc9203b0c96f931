"""_decode_sync, wrong: the target's cache is rewound to the tokens committed before the
target's token t minus one more, len(out.tokens) - 2 (x_n counted twice as "not in the
cache"): the accepted d_a is dropped from it, and the next verify reads its block one
position early.
"""

EXERCISE = "decode_sync"
RULE = "target-rewind"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_sync_equals_target_greedy",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, tokens = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(tokens[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 2)  # the bug: one short
        watch(out, tokens, block_size, (num_accepted, next_token))
