"""d3d_loss, wrong: the anchors are drawn without the generator given, from the global
random state. A seeded run no longer repeats itself, and two calls meant to see the same blocks
(a loss and its ablation) see different ones.
"""

EXERCISE = "d3d_loss"
RULE = "anchors"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_the_loss_takes_its_anchors_from_at_else_draws_k_with_the_generator",)


def d3d_loss(drafter: Drafter, input_ids, loss_mask, *, generator=None, at=None):
    cfg = drafter.d3d_config
    block_size = cfg.block_size
    if at is None:
        at = sample_anchors(loss_mask, cfg.num_anchors)  # the bug: no generator
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
        block_acc = correct.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics
