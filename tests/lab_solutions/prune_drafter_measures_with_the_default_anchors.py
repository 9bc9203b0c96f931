"""prune_drafter, wrong: the measurements take the default anchors and seed, not the
config's val_anchors and seed: a run asked for 16 blocks per answer measures 32, and its seed
changes nothing it measures.
"""

EXERCISE = "prune_drafter"
RULE = "measure"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_pruning_measures_with_the_configs_anchors_and_seed_and_repeats_itself",)


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
        measure = {}  # the bug: the defaults, not the config's
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
            kept = tau_floor is None or tau_after >= tau_floor * tau0
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
