"""_decode_sync, wrong: accept_draft is given a Sampler made from config.temperature, not the
sampler given: it has no generator, so its draws come from torch's global one, and a decode
seeded with a generator no longer repeats itself.
"""

EXERCISE = "decode_sync"
RULE = "sampler"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_sampling_is_reproducible_with_a_generator",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        accepting = Sampler(config.temperature)  # the bug: not the sampler given
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, accepting)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
