"""prune_drafter, wrong: the floor is checked on the removed layer's score, the tau before
recovery, not on the tau re-measured after it. A removal that recovery brings back above the
floor is undone; one whose recovery fails is kept.
"""

EXERCISE = "prune_drafter"
RULE = "recovered"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_the_floor_judges_the_tau_after_recovery_not_the_score",)


def prune_drafter(
    drafter: Drafter, val_batches, train_batches, config=None, *, score=None, **settings
):
    config = with_settings(config, PruneConfig, settings)
    if config.min_layers is None and config.tau_floor is None:
        raise ValueError(
            "give a stopping rule: min_layers (a target depth) or tau_floor "
            "(fraction of unpruned tau)"
        )
    min_layers = config.min_layers
    tau_floor = config.tau_floor
    if score is None:
        score = tau_without_each_layer

    def records():
        teacher = copy.deepcopy(drafter).eval().requires_grad_(False)
        measure = dict(val_anchors=config.val_anchors, seed=config.seed)
        generator = torch.Generator().manual_seed(config.seed)
        tau0, _ = validation_tau(drafter, val_batches, **measure)
        yield {
            "iteration": 0,
            "removed_layer": None,
            "layers": len(drafter.model.get_decoder().layers),
            "tau_before_recovery": tau0,
            "tau_after_recovery": tau0,
            "seconds": 0.0,
            "score_seconds": 0.0,
            "kept": True,
        }
        iteration = 0
        while len(drafter.model.get_decoder().layers) > max(1, min_layers or 1):
            iteration += 1
            start = time.perf_counter()
            original = _original_ids(drafter)
            scores = score(drafter.eval(), val_batches, **measure)
            best = least_costly_layer(drafter, scores, val_batches, **measure)
            score_seconds = time.perf_counter() - start
            snapshot = None
            if tau_floor is not None:
                snapshot = host_copy(drafter)
            remove_layer(drafter, best)
            skipped = recover(drafter, teacher, train_batches, config, generator)
            tau_after = scores[best]
            if config.recovery_steps > 0:
                tau_after = validation_tau(drafter, val_batches, **measure)[0]
            kept = tau_floor is None or scores[best] >= tau_floor * tau0  # the bug
            if not kept:
                _undo_removal(drafter, snapshot, teacher.device)
            layer_taus = {original[i]: round(tau, 4) for i, tau in scores.items()}
            yield {
                "iteration": iteration,
                "removed_layer": original[best],
                "layers": len(original) - 1,
                "tau_before_recovery": scores[best],
                "tau_after_recovery": tau_after,
                "seconds": time.perf_counter() - start,
                "score_seconds": score_seconds,
                "kept": kept,
                "recovery_skipped": skipped,
                "tau_without_layer": layer_taus,
            }
            if not kept:
                break

    return records()
