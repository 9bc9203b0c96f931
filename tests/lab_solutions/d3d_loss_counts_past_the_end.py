"""_block_labels, wrong: "inside the sequence" is asked after the positions are clamped
to the last token, so it is always true. A block near the end then counts the last token again
and again, as the label of every MASK past the end.
"""

EXERCISE = "d3d_loss"
RULE = "counts"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_block_labels_are_the_b_tokens_after_each_anchor_where_they_count",)


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    num_causal = input_ids.shape[1]
    steps = torch.arange(1, block_size + 1, device=anchors.device)
    label_pos = anchors[:, :, None] + steps
    label_pos = label_pos.clamp(max=num_causal - 1)
    inside = label_pos < num_causal  # the bug: asked after the clamp
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    is_response = loss_mask.bool().gather(1, label_pos.flatten(1)).view_as(label_pos)
    counts = inside & is_response & valid[:, :, None]
    return labels, counts
