"""d3d_loss, wrong: block_acc reads every d_i at its MASK, d_1 at MASK 1 whatever d1_from says.
The loss is right (it reads every MASK); the metric no longer tells how often the d_1 that
decoding drafts (under d1_from "causal", the anchor's causal row) is right.
"""

EXERCISE = "d3d_loss"
RULE = "acc-d1"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_block_acc_reads_d1_where_d1_from_says",)  # must fail (others may too)


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
    loss_ar = torch.zeros((), device=input_ids.device)
    if cfg.ar_weight > 0:
        has_label = loss_mask[:, 1:].bool()
        ar_tok, _ = cross_entropy(
            drafter, causal_hidden[:, :-1][has_label], input_ids[:, 1:][has_label]
        )
        loss_ar = ar_tok.sum() / has_label.sum().clamp(min=1)
    with torch.no_grad():
        correct = torch.zeros_like(counts)
        correct[counts] = predicted == labels[counts]  # the bug: d_1 from MASK 1 here too
        block_acc = correct.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics
