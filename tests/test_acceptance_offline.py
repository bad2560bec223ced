"""Acceptance regressions for the offline API: bad values raise a ValueError naming the field."""

from __future__ import annotations

import pytest

from kvserve.runtime import SamplingParams


@pytest.mark.parametrize("fields, field", [
    (dict(stop=5), "stop"),
    (dict(stop=True), "stop"),
    (dict(seed=2**64), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
])
def test_bad_value_names_the_field(fields, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**fields)


def test_edge_values_still_accepted():
    assert SamplingParams(seed=2**63 - 1, n=16).seed == 2**63 - 1
    assert SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop="a").stop == ["a"]
