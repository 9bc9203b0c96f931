"""_block_labels, wrong: MASK i is labelled x_{j+i-1}, one token early (i counted from
0): MASK 1 learns to repeat its anchor, a token the block already sees, and every later MASK
the token before the one it drafts at decoding.
"""

EXERCISE = "d3d_loss"
RULE = "labels"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_block_labels_are_the_b_tokens_after_each_anchor_where_they_count",)


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    num_causal = input_ids.shape[1]
    steps = torch.arange(block_size, device=anchors.device)  # the bug: from 0
    label_pos = anchors[:, :, None] + steps
    inside = label_pos < num_causal
    label_pos = label_pos.clamp(max=num_causal - 1)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    is_response = loss_mask.bool().gather(1, label_pos.flatten(1)).view_as(label_pos)
    counts = inside & is_response & valid[:, :, None]
    return labels, counts
