"""_decode_sync, wrong: the accepted count is read with .item() to slice the draft, then the
rest comes in read_round: two host reads a round. The tokens are right; on CUDA the host
stalls twice a round, waiting for the device to drain its queue each time.
"""

EXERCISE = "decode_sync"
RULE = "one-read"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_each_round_reads_the_device_once_between_two_reports",)


def _decode_sync(drafter, out, caches, config, *, sampler, watch):
    tc, dc = caches.target, caches.drafter
    block_size = config.block_size
    while not out.done:
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        accepted = num_accepted.item()  # the bug: a second read
        next_token, tokens = read_round([next_token, draft], tc, dc)
        out.commit_round(tokens[:accepted], next_token)
        tc.rewind(len(out.tokens) - 1)
        watch(out, tokens, block_size, (accepted, next_token))
