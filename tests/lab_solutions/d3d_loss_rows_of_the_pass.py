"""d3d_loss, right, written another way: one pass's hidden states put back in a row, block_acc
read at the rows draft_rows gives (as offline_tau and decoding read a block), L_block and L_AR
as weighted sums over per-row weights that are zero where a label does not count, and the
labels' places as a mask of the anchors plus an offset.
"""

EXERCISE = "d3d_loss"
RIGHT = True
FAILS = ()  # tests that must fail: none


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    num_causal = input_ids.shape[1]
    offset = torch.arange(block_size, device=anchors.device) + 1  # i = 1 .. B
    place = anchors.unsqueeze(-1) + offset  # (b, K, B) j_k + i
    exists = place <= num_causal - 1
    place = torch.minimum(place, torch.full_like(place, num_causal - 1))
    flat = place.reshape(place.shape[0], -1)
    labels = torch.gather(input_ids, 1, flat).reshape(place.shape)
    response = torch.gather(loss_mask.bool(), 1, flat).reshape(place.shape)
    return labels, exists & response & valid.unsqueeze(-1)


def d3d_loss(drafter, input_ids, loss_mask, *, generator=None, at=None):
    cfg = drafter.d3d_config
    block_size, num_causal = cfg.block_size, input_ids.shape[1]
    anchors, valid = at if at is not None else sample_anchors(loss_mask, cfg.num_anchors, generator)
    causal_hidden, block_hidden = _packed_hidden(drafter, input_ids, anchors, block_size)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    w_i = _position_weights(block_size, cfg.decay_gamma, input_ids.device).expand_as(counts)
    row_loss, _ = cross_entropy(drafter, block_hidden[counts], labels[counts])
    loss_block = (row_loss * w_i[counts]).sum() / w_i[counts].sum().clamp(min=1e-8)
    loss_ar = input_ids.new_zeros((), dtype=torch.float32)
    if cfg.ar_weight > 0:
        next_is_response = loss_mask[:, 1:].bool()
        ar_loss, _ = cross_entropy(
            drafter, causal_hidden[:, :-1][next_is_response], input_ids[:, 1:][next_is_response]
        )
        loss_ar = ar_loss.mean() if ar_loss.numel() else loss_ar
    with torch.no_grad():
        hidden = torch.cat([causal_hidden, block_hidden.flatten(1, 2)], 1)  # the pass's rows
        first_masks = num_causal + block_size * torch.arange(
            anchors.shape[1], device=anchors.device
        )
        rows = draft_rows(anchors, first_masks, block_size, cfg.d1_from)  # (b, K, B)
        picked = hidden.gather(1, rows.flatten(1)[..., None].expand(-1, -1, hidden.shape[-1]))
        draft = _greedy_tokens(drafter, picked.view(*rows.shape, -1)[counts])
        right = torch.zeros_like(counts)
        right[counts] = draft == labels[counts]
        block_acc = right.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics
