"""_decode_sync, wrong: B is the drafter's trained block size, not config.block_size: a
decode asked for another B (generate's block_size, decode.py --block-size) drafts and
verifies blocks of the trained size, and tells its watchers so.
"""

EXERCISE = "decode_sync"
RULE = "b"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_sync_round_is_watched_once_after_its_commit_and_rewind",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = drafter.d3d_config.block_size  # the bug: not the config's
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        out.commit_round(draft[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))
