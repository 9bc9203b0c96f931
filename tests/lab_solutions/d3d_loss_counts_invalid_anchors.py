"""_block_labels, wrong: a label counts where it exists and is a response token, but the anchor's
`valid` is left out. A sequence with fewer than K places for an anchor gets blocks off
arbitrary positions (sample_anchors marks them invalid), and they now carry loss.
"""

EXERCISE = "d3d_loss"
RULE = "valid"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_loss_ignores_blocks_of_invalid_anchors",)  # must fail (others may too)


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    num_causal = input_ids.shape[1]
    steps = torch.arange(1, block_size + 1, device=anchors.device)
    label_pos = anchors[:, :, None] + steps
    inside = label_pos < num_causal
    label_pos = label_pos.clamp(max=num_causal - 1)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    is_response = loss_mask.bool().gather(1, label_pos.flatten(1)).view_as(label_pos)
    return labels, inside & is_response  # the bug: valid is not asked
