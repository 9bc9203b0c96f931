"""prune_drafter, wrong: the floor is tau_floor x the tau of the last kept depth, not of the
unpruned drafter. Each removal is then judged against a floor that falls with it, and pruning
runs on far past the fraction of the unpruned tau the user asked to keep.
"""

EXERCISE = "prune_drafter"
RULE = "floor"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_the_floor_is_a_fraction_of_the_unpruned_tau_with_scores_given",)  # must fail


def prune_drafter(drafter, val_batches, train_batches, config=None, *, score=None, **settings):
    cfg = with_settings(config, PruneConfig, settings)
    if cfg.min_layers is None and cfg.tau_floor is None:
        raise ValueError("give a stopping rule: min_layers or tau_floor")
    score = tau_without_each_layer if score is None else score

    def records():
        teacher = copy.deepcopy(drafter).eval().requires_grad_(False)
        measure = dict(val_anchors=cfg.val_anchors, seed=cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed)
        tau0, _ = validation_tau(drafter, val_batches, **measure)
        layers = len(drafter.model.get_decoder().layers)
        yield {
            "iteration": 0,
            "removed_layer": None,
            "layers": layers,
            "tau_before_recovery": tau0,
            "tau_after_recovery": tau0,
            "seconds": 0.0,
            "score_seconds": 0.0,
            "kept": True,
        }
        iteration, tau_last = 0, tau0
        while len(drafter.model.get_decoder().layers) > max(1, cfg.min_layers or 1):
            iteration += 1
            start = time.perf_counter()
            original = _original_ids(drafter)
            scores = score(drafter.eval(), val_batches, **measure)
            best = least_costly_layer(drafter, scores, val_batches, **measure)
            score_seconds = time.perf_counter() - start
            snapshot = host_copy(drafter) if cfg.tau_floor is not None else None
            remove_layer(drafter, best)
            skipped = recover(drafter, teacher, train_batches, cfg, generator)
            tau_after = scores[best]
            if cfg.recovery_steps > 0:
                tau_after = validation_tau(drafter, val_batches, **measure)[0]
            kept = cfg.tau_floor is None or tau_after >= cfg.tau_floor * tau_last  # the bug
            if kept:
                tau_last = tau_after
            if not kept:
                _undo_removal(drafter, snapshot, teacher.device)
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
                "tau_without_layer": {original[i]: round(t, 4) for i, t in scores.items()},
            }
            if not kept:
                break

    return records()
