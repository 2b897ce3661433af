"""The policy document's field types (gateway/policy/schema.py): names, key ids, globs,
InferenceObjective names, and the numbers operators write (counts, rates, prices, weights),
read one way from a file and from a CLI flag (`1e6`, `10k`, `1_000` as the schema reads
them). Each refusal says why, and pydantic prefixes the path."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints

from gateway.policy.secrets import KEY_ID_PATTERN, KEY_ID_RULE

# No control characters (C0, DEL, C1): names become Redis keys, \x1f-separated script
# arguments and header values (x-gateway-team, x-gateway-model).
Name = Annotated[str, StringConstraints(min_length=1, max_length=128,
                                        pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")]
def _key_id(value: str) -> str:
    if not re.fullmatch(KEY_ID_PATTERN, value):
        raise ValueError(f"key id {value[:80]!r} is not {KEY_ID_RULE}")
    return value


KeyId = Annotated[str, AfterValidator(_key_id)]

# A Kubernetes object name (DNS-1123 subdomain), as an InferenceObjective resource's is.
_DNS1123_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(?:\.{_DNS1123_LABEL})*")


def objective_name(value: str) -> str:
    """`value`, if it can name an InferenceObjective (a Kubernetes object name, DNS-1123
    subdomain); else ValueError saying why. The CLI's --inference-objective reads it too."""
    if len(value) > 253:
        raise ValueError(f"{value[:40]!r}... is {len(value)} characters long: a Kubernetes "
                         "object name (an InferenceObjective's) has at most 253")
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a Kubernetes object name (an InferenceObjective's): at "
            "most 253 characters, lowercase letters, digits, '-' and '.', each '.'-separated "
            "part starting and ending with a letter or digit")
    return value


# The name of a Gateway API Inference Extension InferenceObjective: sent to the engine's
# endpoint picker as x-gateway-inference-objective, which resolves it to a priority.
ObjectiveName = Annotated[str, AfterValidator(objective_name)]
Sha256Hex = Annotated[
    str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$"), AfterValidator(str.lower)]
Glob = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# Limits are counted in Redis's Lua, whose numbers are doubles: exact up to 2**53. Above it a
# limit would be rounded (and above 2**63 refused by the store itself, after validation).
MAX_COUNT = 2**53 - 1


class NotANumber(ValueError):
    """Text where a number belongs that spells none (`10k`, `1,000`): `fix` is the number
    it likely means, "" when none is clear. The loader names its line."""

    def __init__(self, text: str, fix: str) -> None:
        self.text, self.fix = text, fix
        super().__init__(f"text {text!r}, not a number" + (f": write {fix}" if fix else ""))


_SUFFIX = re.compile(r"([0-9][0-9_]*(?:\.[0-9_]+)?)\s*([kKMGBbT])")
_SCALE = {"k": 3, "K": 3, "M": 6, "G": 9, "B": 9, "b": 9, "T": 12}


def _digits(number: Decimal) -> str:
    """A finite number as YAML 1.1 and JSON read it alike: `1000000`, `0.0015`."""
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def _spelled(text: str) -> Decimal | None:
    try:
        number = Decimal(text.strip())
    except InvalidOperation:
        return None
    return number if number.is_finite() else None


def _not_a_number_fix(text: str) -> str:
    """The number text that spells none likely means: `10k` 10000, `1,000,000` 1000000."""
    if (m := _SUFFIX.fullmatch(text.strip())) and (n := _spelled(m[1])) is not None:
        return _digits(n.scaleb(_SCALE[m[2]]))
    if re.fullmatch(r"\s*[0-9]{1,3}(?:([, ])[0-9]{3})(?:\1[0-9]{3})*\s*", text):
        return _digits(Decimal(re.sub(r"[, ]", "", text)))
    return ""


def _a_number(value: object) -> object:
    """pydantic reads true as 1, so YAML's `concurrency: yes` (true) was a limit of 1.
    Text is read as the number it spells, in every numeric field alike: YAML 1.1 reads
    `1e6` (no dot, or no sign in the exponent) as text, and pydantic read that text as a
    float (`rps: 1e6`) but not as an integer (`tokens_per_day: 1e6` was refused, "unable
    to parse string as an integer"). Text that spells no number (`10k`) is refused by
    `NotANumber`, with the number it likely means."""
    if isinstance(value, bool):
        raise ValueError(f"a number, not {str(value).lower()}")
    if isinstance(value, str):
        return read_number(value)
    return value


def not_a_count(number: float) -> str | None:
    """Why a float (as `read_number` gives a fraction, or a number too large for an int:
    `1e20`) cannot be a count of requests or tokens, None if it can. The policy file and
    the command line's limit flags both ask it; before, a whole number past any count was
    refused as a malformed number (pydantic: "exceeded maximum size") or as a fraction."""
    if not number.is_integer():
        return "is not a whole number"
    if number < 0:
        return "is below 0"
    return f"is more than any count: at most {MAX_COUNT}" if number > MAX_COUNT else None


def _a_count(value: object) -> object:
    """`_a_number`, for a whole-number field, refused as `not_a_count` says."""
    number = _a_number(value)
    if isinstance(number, float) and (problem := not_a_count(number)):
        raise ValueError(f"{value} {problem}")
    return number


def read_number(text: str) -> int | float:
    """The number `text` spells, as every numeric field of the policy reads it: `1e6` and
    `1000000` are 1000000 (an int when whole), `0.5` is 0.5. Text that spells none
    (`10k`, `1,000`, `nan`) raises `NotANumber`, with the number it likely means. The
    command line's limit flags read theirs with it, so a flag takes what a file takes."""
    number = _spelled(text)
    if number is None:
        raise NotANumber(text, _not_a_number_fix(text))
    if number.adjusted() > 18:  # beyond every range: no billion-digit int from 1e999999999
        return float(number)
    return int(number) if number == number.to_integral_value() else float(number)


_NUMBER = BeforeValidator(_a_number)
_COUNT = BeforeValidator(_a_count)
Count = Annotated[int, Field(ge=0, le=MAX_COUNT), _COUNT]
Rate = Annotated[float, Field(gt=0, le=MAX_COUNT, allow_inf_nan=False), _NUMBER]
PerMillion = Annotated[float, Field(ge=0, allow_inf_nan=False), _NUMBER]
Weight = Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False), _NUMBER]
PositiveCount = Annotated[int, Field(ge=1, le=MAX_COUNT), _COUNT]  # a burst, a revision
