"""`request_facts.RequestFacts`: what a decision derives from a request alone, kept per request
(and options) object, is what it works out afresh; a request or options object it has not seen,
even an equal one, is worked out afresh; the memo key keeps the budget's types apart."""

from __future__ import annotations

import random

from tessera.scheduler.card_summaries import Need
from tessera.scheduler.refusal_memo import sketch
from tessera.scheduler.request_facts import RequestFacts
from tessera.scheduler.rules import parse_pod_options

from tessera.hami import PodRequest, parse_pod_request
from tessera.settings import TesseraSettings

from .factories import container, pod

SETTINGS = TesseraSettings()


def random_pod(rng: random.Random) -> dict:
    def one(name: str) -> dict:
        return container(name, gpus=rng.choice([0, 1, 2, 4, 8]),
                         mem=rng.choice([None, 1024, 4096, 30000]),
                         pct=rng.choice([None, None, 25, 50]),
                         cores=rng.choice([None, 0, 30, 100]))  # fmt: skip

    containers = [one(f"c{i}") for i in range(rng.randint(1, 3))]
    init = [one(f"i{i}") for i in range(rng.randint(0, 2))]
    policy = rng.choice([None, "binpack", "spread"])
    annotations = {"hami.io/node-scheduler-policy": policy} if policy else None
    return pod(*containers, init=init or None, annotations=annotations)


def test_facts_are_the_requests_own_whether_kept_or_not() -> None:
    rng = random.Random(5)
    facts = RequestFacts()
    seen: list[tuple[PodRequest, object]] = []
    for _ in range(600):
        spec = random_pod(rng)
        request = parse_pod_request(spec, SETTINGS)
        options = parse_pod_options(spec, SETTINGS)
        if seen and rng.random() < 0.3:  # (an object met before: answered from the memory)
            request, options = rng.choice(seen)
        seen.append((request, options))
        kept = facts.of(request)
        assert kept.request is request
        assert kept.needs == Need.of(request)
        assert kept.together == Need.together(request)
        assert kept.sketch == sketch(request)
        for budget in ((None, None), (4096, None), (None, 50), (0, 0)):
            assert facts.memo_key(request, options, *budget) == repr((request, options, *budget))


def test_an_equal_object_not_seen_is_worked_out_afresh_and_types_stay_apart() -> None:
    spec = pod(container(gpus=2, mem=4096))
    facts = RequestFacts()
    request = parse_pod_request(spec, SETTINGS)
    options = parse_pod_options(spec, SETTINGS)
    twin = PodRequest(init=list(request.init), containers=list(request.containers),
                      sidecars=request.sidecars)  # fmt: skip
    assert twin == request and twin is not request
    assert facts.of(request).request is request
    assert facts.of(twin).request is twin  # (its own entry, by identity)
    assert facts.memo_key(request, options, 1, None) == repr((request, options, 1, None))
    assert facts.memo_key(request, options, True, None) == repr((request, options, True, None))
    assert facts.memo_key(request, options, 1.0, None) == repr((request, options, 1.0, None))


def test_the_memory_starts_over_when_full() -> None:
    facts = RequestFacts()
    facts.KEEP = 4
    requests = [parse_pod_request(pod(container(gpus=1, mem=1024 * (i + 1))), SETTINGS)
                for i in range(10)]  # fmt: skip
    for request in requests * 2:
        assert facts.of(request).needs == Need.of(request)
    assert len(facts._facts) <= 4
