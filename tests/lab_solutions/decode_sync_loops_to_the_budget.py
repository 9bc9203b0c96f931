"""_decode_sync, wrong: the loop runs until max_new_tokens are committed, not until out.done:
an EOS committed inside a round does not stop it, and the next round commits to a finished
sequence.
"""

EXERCISE = "decode_sync"
RULE = "until-done"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_sync_stops_at_eos_inside_an_accepted_block",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    # the bug: the budget alone
    while len(out.tokens) < out.prompt_len + config.max_new_tokens:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
