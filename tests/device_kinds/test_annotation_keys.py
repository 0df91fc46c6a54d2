"""Admission's list of the annotations device families read follows the registry: a family
registered after the list was first used is known, and one unregistered is forgotten. (It was
computed once per process, so which families it knew depended on which test asked first.)"""

from __future__ import annotations

from tessera.admission import rules as admission

from tessera.device_kinds import ResourceNames, registry
from tessera.device_kinds.nvidia import NVIDIA
from tessera.settings import TesseraSettings

KEY = "hami.io/test-keys-use-type"


class Keyed(type(NVIDIA)):  # a family of its own that reads one more selection annotation
    name = "test-keys"
    use_type_annotation = KEY
    nouse_type_annotation = use_uuid_annotation = nouse_uuid_annotation = mode_annotation = ""

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        return ResourceNames("example.com/test-keys")

    def resource_names(self, settings: TesseraSettings) -> ResourceNames:
        return self.default_names(settings)


def _warnings(annotations: dict[str, str]) -> list[str]:
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u1",
                        "annotations": annotations},
           "spec": {"containers": [{"name": "main", "image": "x"}]}}  # fmt: skip
    decision = admission.decide(pod, "default", TesseraSettings())
    assert isinstance(decision, admission.Admitted), decision
    return [w for w in decision.warnings if KEY in w]


def test_a_family_registered_later_has_its_annotations_known_and_forgotten_when_it_goes():
    assert _warnings({KEY: "x"}), "not registered yet: a key nobody reads"
    registry.register(Keyed())
    try:
        assert _warnings({KEY: "x"}) == []
    finally:
        registry.unregister(Keyed.name)
    assert _warnings({KEY: "x"}), "unregistered: nobody reads it any more"
