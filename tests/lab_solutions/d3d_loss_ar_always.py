"""d3d_loss, wrong: L_AR is computed whatever lambda is. The loss is still L_block + lambda *
L_AR (at lambda = 0 the term weighs nothing), but loss_ar reports a term that was not
trained, and a lambda = 0 ablation pays for a projection it throws away.
"""

EXERCISE = "d3d_loss"
RULE = "ar-at-0"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_the_ar_term_is_zero_at_lambda_0",)  # must fail (others may too)


def d3d_loss(drafter, input_ids, loss_mask, *, generator=None, at=None):
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
    has_label = loss_mask[:, 1:].bool()  # the bug: no `if lambda > 0`
    ar_tok, _ = cross_entropy(
        drafter, causal_hidden[:, :-1][has_label], input_ids[:, 1:][has_label]
    )
    loss_ar = ar_tok.sum() / has_label.sum().clamp(min=1)
    with torch.no_grad():
        correct = torch.zeros_like(counts)
        correct[counts] = predicted == labels[counts]
        if cfg.d1_from == "causal":
            first = counts[:, :, 0]
            index = anchors[:, :, None].expand(-1, -1, causal_hidden.shape[-1])
            d1 = _greedy_tokens(drafter, causal_hidden.gather(1, index)[first])
            correct[:, :, 0][first] = d1 == labels[:, :, 0][first]
        block_acc = correct.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics
