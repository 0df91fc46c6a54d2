"""Issue 34: a grant above the pod's request is sealed only when it equals the record limits.set
signed on the pod with the node agent's own key; the same annotation written by anyone else (a
`pods/status` writer, a forged UPDATE) is a forgery and is refused. Real NATS, the real agent
over real unix-socket gRPC."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera import hami, signing

sys.path.insert(0, str(Path(__file__).parents[1] / "node_agent"))
from node_agent_rig import grants, running_rig


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tsg-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pod(name: str, allocated: str, signature: str | None) -> dict:
    annotations = {hami.ANN_DEVICES_ALLOCATED: allocated}
    if signature:
        annotations[signing.RECORD_ANNOTATION] = signature
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}",
                     "annotations": annotations},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000, "nvidia.com/gpucores": 20}}}]},
    }  # fmt: skip


async def test_only_the_agents_own_signed_record_lifts_a_grant_above_the_request(
    short_dir, nc, buckets
):
    key = signing.new_key()
    key_file = short_dir / "agent.pem"
    key_file.write_bytes(signing.private_pem(key))
    async with running_rig(short_dir / "r", nc, buckets, command_key_file=str(key_file)) as rig:
        # The agent signs as its process's NATS user (none here: the name is empty).
        own = signing.Signer("", key)
        stranger = signing.Signer("", signing.new_key())
        cases = [  # (pod, who signed the record, for which uid, sealed?)
            ("forged", None, "", False),  # the annotation alone: what a pods/status writer can do
            ("strange", stranger, "uid-strange", False),  # another key
            ("moved", own, "uid-other-pod", False),  # the agent's record, copied from elsewhere
            ("raised", own, "uid-raised", True),  # what limits.set writes
        ]
        for index, (name, signer, signed_uid, sealed) in enumerate(cases):
            grant = [grants((rig.gpus[index % 2], 12000, 60))]  # 3x the 4000 MiB asked
            value = hami.encode_pod_devices(grant)
            signature = signing.record_signature(signer, signed_uid, value) if signer else None
            spec = pod(name, value, signature)
            await rig.bind(spec, grant)
            admission = await rig.kubelet.admit_pod(spec)
            assert admission.ok is sealed, (name, admission.error)
            if not sealed:
                assert "the pod asks 4000 MiB" in admission.error, admission.error
            rig.kubelet.remove_pod(spec["metadata"]["uid"])
