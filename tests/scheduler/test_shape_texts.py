"""A refusal shape worded from its key (`shape_texts.ShapeTexts`) says what fitting each of its
nodes says: the same text and the same reasons, for pods of one container and of several, under
GPU policies, mutex, type selections (a class's static check), percentages and whole cards; a
shape whose key does not say it all (cards out of slots, unhealthy or cordoned) is left to the
fit."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.refusal_shapes import first_step, group
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options
from tessera.scheduler.shape_texts import UNWORDED

from tessera import hami
from tessera.settings import TesseraSettings

from .test_native_steps import HUGE_WEIGHTS, cluster, several

SETTINGS = TesseraSettings()


def one(rng: random.Random, i: int) -> dict:
    """A pod of one GPU container (the `several` pod's first)."""
    spec = several(rng, i)
    spec["spec"]["containers"] = spec["spec"]["containers"][:1]
    return spec


@pytest.mark.parametrize("seed", [51, 52])
def test_a_worded_shape_says_what_fitting_its_nodes_says(seed: int) -> None:
    index, names, rng = cluster(seed, 120, False)
    slots = np.asarray([index.slot_of[name] for name in names], dtype=np.int64)
    worded = {"one": 0, "several": 0, "fits": 0, "left": 0}
    for i in range(120):
        spec = one(rng, i) if i % 3 == 0 else several(rng, i)
        request = hami.parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        step = first_step(request, options, QuotaBudget())
        if step is None or step[1] is not None:
            continue
        steps = step[0]
        texts = index.card_classes.shared_texts(steps)  # type: ignore[arg-type]
        assert texts is not None
        groups, keys, _first = group(index, slots, steps)  # type: ignore[arg-type]
        for g, key in enumerate(keys):
            members = slots[groups == g]
            if not len(members):
                continue  # (the rows not grouped, as `grouped` may number them)
            shared = index.card_classes.shared_key(steps, key)  # type: ignore[arg-type]
            assert shared is not None
            said = texts.word(shared[1], shared[2])
            if said is UNWORDED:
                worded["left"] += 1
                continue
            for slot in members.tolist():
                fit = fit_pod(index.entry_at(slot).cards, request, FitContext(options))
                if said is None:
                    assert fit.ok, (i, key)
                    continue
                assert not fit.ok, (i, key)
                text, reasons = said
                assert text == fit.reason_text(), (i, key)
                assert Counter(reasons) == Counter(fit.reasons.keys()), (i, key)
            if said is None:
                worded["fits"] += 1
            else:
                worded["several" if len(steps.containers) > 1 else "one"] += 1  # type: ignore[attr-defined]
    assert all(n > 5 for n in worded.values()), worded


def test_a_shape_with_cards_that_take_no_pod_is_left_to_the_fit() -> None:
    """A node with a cordoned card: its key's signature is not 0, so the text is fitted."""
    index, names, rng = cluster(53, 30, False)
    target = names[0]
    index.set_cordon(target, frozenset({index.entries[target].cards[0].uuid}), 0.0)
    spec = several(rng, 0)
    spec["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 13  # (no node)
    request = hami.parse_pod_request(spec, SETTINGS)
    step = first_step(request, parse_pod_options(spec, SETTINGS), QuotaBudget())
    assert step is not None
    steps = step[0]
    texts = index.card_classes.shared_texts(steps)  # type: ignore[arg-type]
    assert texts is not None
    slot = index.slot_of[target]
    groups, keys, _first = group(index, np.asarray([slot], dtype=np.int64), steps)  # type: ignore[arg-type]
    assert groups[0] >= 0  # (refused at its first step: the key names its signature)
    shared = index.card_classes.shared_key(steps, keys[int(groups[0])])  # type: ignore[arg-type]
    assert shared is not None
    assert texts.word(shared[1], shared[2]) is UNWORDED
    assert shared not in texts


def test_huge_scoring_weights_are_refused_as_fitting_each_node_says() -> None:
    """HAMi takes any integer weight (Tessera's admission up to 18 digits); a pod's steps
    compute device scores in int64 and doubles, exact only for weights up to
    `refusal_shapes._EXACT_WEIGHT` (18-digit weights lost precision and picked other cards than
    the fit). Such a pod is grouped by its first container, so every node's reason is the
    fit's."""
    from tessera.scheduler.decide import decide

    from .test_decision_reference import reference

    index, names, rng = cluster(51, 120, False)
    for i in range(104):  # (the cluster's random stream as the pod below found it)
        spec = one(rng, i) if i % 3 == 0 else several(rng, i)
    weights = spec["metadata"]["annotations"]["hami.io/device-scoring-weights"]
    assert weights == HUGE_WEIGHTS, weights
    want_fitting, want_failed = reference(index, spec, names)
    assert not want_fitting
    request = hami.parse_pod_request(spec, SETTINGS)
    decision = decide(index, request, parse_pod_options(spec, SETTINGS), names)
    assert next(decision.fits(), None) is None
    decision.explain_rest()
    assert dict(decision.failed) == want_failed
