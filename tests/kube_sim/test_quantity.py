"""Quantities as kube-apiserver reads and writes them (API reference "Quantity"; apimachinery's
ParseQuantity / CanonicalizeBytes), and how Tessera reads a GPU memory quantity."""

from __future__ import annotations

import json

import pytest

from tessera.quantity import JsonNumber, QuantityError, canonical, whole_mib

MEM = "nvidia.com/gpumem"


@pytest.mark.parametrize(("written", "stored"), [
    # the API reference's own examples, and the issue's
    ("1.5", "1500m"), ("1.5Gi", "1536Mi"), ("3000", "3k"), ("4096", "4096"), ("1e3", "1e3"),
    # decimal SI: the largest suffix that loses nothing, exponent a multiple of 3
    ("10000", "10k"), ("1000000", "1M"), ("1500", "1500"), ("100", "100"), ("0.1", "100m"),
    ("1000m", "1"), ("12M", "12M"), ("1E", "1E"), ("0", "0"), ("-1.5", "-1500m"), ("+5", "5"),
    (".5", "500m"), ("1.", "1"),
    # exponent family kept
    ("1e4", "10e3"), ("12e2", "1200"), ("1e-3", "1e-3"), ("1.5e3", "1500"),
    # binary SI: whole multiples of 1024 keep a binary suffix, the rest turns decimal
    ("2048Mi", "2Gi"), ("1048576Ki", "1Gi"), ("1.5Ki", "1536"), ("0.5Ki", "512"),
    ("1.1Ki", "1126400m"), ("1Ki", "1Ki"), ("100Mi", "100Mi"),
    # precision below 1n rounds up; a binary value is capped at 2^63-1
    ("0.0000000001", "1n"), ("8Ei", "9223372036854775807"),
    # JSON numbers: YAML `gpumem: 3000` reaches the server as the number 3000
    (3000, "3k"), (1.5, "1500m"),
])
def test_canonical_form(written: object, stored: str) -> None:
    assert canonical(written) == stored


def test_a_json_number_keeps_its_family() -> None:
    body = json.loads('{"a": 1e3, "b": 1.5}', parse_float=JsonNumber.of)
    assert canonical(body["a"]) == "1e3" and canonical(body["b"]) == "1500m"


@pytest.mark.parametrize(("bad", "message"), [
    ("", "quantities must match the regular expression"),
    ("abc", "quantities must match the regular expression"),
    ("1.2.3", "quantities must match the regular expression"),
    ("1K", "unable to parse quantity's suffix"),
    ("1Gi2", "unable to parse quantity's suffix"),
    ("1e", "unable to parse quantity's suffix"),
])
def test_what_is_no_quantity(bad: str, message: str) -> None:
    with pytest.raises(QuantityError, match=message):
        canonical(bad)


@pytest.mark.parametrize(("written", "mib"), [
    ("3k", 3000), ("12k", 12000), ("1e3", 1000), ("3000", 3000), (3000, 3000), ("1.5k", 1500),
    ("3000000m", 3000), ("12M", 12_000_000), ("10e3", 10000),
])
def test_every_canonical_decimal_form_is_the_mib_it_says(written: object, mib: int) -> None:
    assert whole_mib(written, MEM) == mib
    assert whole_mib(canonical(written), MEM) == mib  # and what the API server writes back


@pytest.mark.parametrize(("written", "says"), [
    ("4Gi", f"write {MEM}: 4096 (MiB)"), ("512Mi", f"write {MEM}: 512 (MiB)"),
    ("1.5", "'1.5' is 1.5 MiB, not a whole number of MiB"),
    ("1500m", f"write {MEM}: 2 (MiB, rounded up)"), ("lots", "is not a quantity"),
])
def test_binary_units_and_fractions_are_refused_saying_what_to_write(written: str,
                                                                     says: str) -> None:
    with pytest.raises(QuantityError, match=says.replace("(", r"\(").replace(")", r"\)")):
        whole_mib(written, MEM)


@pytest.mark.parametrize(("written", "mib"), [
    ("8000", 8000), ("8k", 8000), ("160k", 160000), ("1e3", 1000), ("160Gi", 163840),
    ("512Mi", 512), ("80G", 80 * 10**9 // 2**20), (8000, 8000),
])
def test_a_namespace_total_reads_the_api_servers_forms_and_bytes(written: object,
                                                                 mib: int) -> None:
    """ResourceQuota `limits.nvidia.com/gpumem` and `tessera quota set --memory` (one rule)."""
    from tessera.quantity import namespace_mib

    assert namespace_mib(written, MEM) == mib
