"""Settings refused at start, with the setting named, rather than misbehaving later."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.settings import Settings


@pytest.mark.parametrize(("field", "value", "says"), [
    ("spoke", "eu/west", "must not contain '/'"),
    ("instance_id", "host/1", "must not contain '/'"),
    ("spoke", "*", "must name this spoke"),
    ("spoke", " ", "must name this spoke"),
    ("status_interval_s", 0, "greater than 0"),
])
def test_a_value_the_hub_contract_cannot_carry_is_refused(field: str, value: object,
                                                          says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(**{field: value})
    assert field in str(err.value) and says in str(err.value)


def test_the_defaults_and_ordinary_names_are_taken() -> None:
    s = Settings(spoke="eu-west-1", instance_id="host-7")
    assert (s.spoke, s.instance_id, s.status_interval_s) == ("eu-west-1", "host-7", 10.0)
