"""d3d_loss, wrong: block_acc divides the right guesses at each position by every block,
not by the blocks whose label there counts. Positions whose labels often fall past the end or on
the prompt look worse than they are, the later ones most.
"""

EXERCISE = "d3d_loss"
RULE = "acc-share"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_block_acc_is_each_positions_share_of_the_counted_blocks_it_gets_right",)


def d3d_loss(drafter: Drafter, input_ids, loss_mask, *, generator=None, at=None):
    cfg = drafter.d3d_config
    block_size = cfg.block_size
    if at is None:
        at = sample_anchors(loss_mask, cfg.num_anchors, generator)
    anchors, valid = at
    causal_hidden, block_hidden = _packed_hidden(drafter, input_ids, anchors, block_size)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    weights = _position_weights(block_size, cfg.decay_gamma, input_ids.device)
    token_loss, predicted = cross_entropy(drafter, block_hidden[counts], labels[counts])
    w = (counts * weights)[counts]
    loss_block = (token_loss * w).sum() / w.sum().clamp(min=1e-8)
    loss_ar = torch.zeros((), device=input_ids.device)
    if cfg.ar_weight > 0:
        has_label = loss_mask[:, 1:].bool()
        ar_hidden = causal_hidden[:, :-1][has_label]
        ar_tok, _ = cross_entropy(drafter, ar_hidden, input_ids[:, 1:][has_label])
        loss_ar = ar_tok.sum() / has_label.sum().clamp(min=1)
    with torch.no_grad():
        correct = torch.zeros_like(counts)
        correct[counts] = predicted == labels[counts]
        if cfg.d1_from == "causal":
            first = counts[:, :, 0]
            hidden_size = causal_hidden.shape[-1]
            index = anchors[:, :, None].expand(-1, -1, hidden_size)
            anchor_hidden = causal_hidden.gather(1, index)
            d1 = _greedy_tokens(drafter, anchor_hidden[first])
            correct[:, :, 0][first] = d1 == labels[:, :, 0][first]
        block_acc = correct.sum((0, 1)) / (counts.shape[0] * counts.shape[1])  # the bug
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics
