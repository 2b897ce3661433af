"""The policy document's field types (gateway/policy/schema.py): names, key ids, globs,
InferenceObjective names, and the numbers operators write (counts, rates, prices, weights),
read one way from a file and from a CLI flag (`1e6`, `10k`, `1_000` as the schema reads
them). Each refusal says why, and pydantic prefixes the path."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BeforeValidator,
    Field,
    StringConstraints,
    WithJsonSchema,
)

from gateway.policy.secrets import KEY_ID_PATTERN, KEY_ID_RULE

# No control characters (C0, DEL, C1): names become Redis keys, \x1f-separated script
# arguments and header values (x-gateway-team, x-gateway-model).
Name = Annotated[str, StringConstraints(min_length=1, max_length=128,
                                        pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")]
def _key_id(value: str) -> str:
    if not re.fullmatch(KEY_ID_PATTERN, value):
        raise ValueError(f"key id {value[:80]!r} is not {KEY_ID_RULE}")
    return value


KeyId = Annotated[str, AfterValidator(_key_id),
                  WithJsonSchema({"type": "string", "pattern": KEY_ID_PATTERN})]

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
ObjectiveName = Annotated[str, AfterValidator(objective_name), WithJsonSchema(
    {"type": "string", "maxLength": 253, "pattern": f"^{_DNS1123_SUBDOMAIN.pattern}$"})]
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


# What `gateway policy schema` says each number accepts (gateway/policy/json_schema.py): a
# JSON/YAML number in the field's range, or text `read_number` reads (YAML 1.1 reads `1e6`
# as text). The text's value is not compared with the range: only its sign, whether it is
# 0, and (without an exponent) whether it has a fraction are in the pattern.
_U = "_*"  # Decimal drops every '_' of the stripped text: `1_000`, even `_1` and `1__0`
_DIGIT = "[0-9]_*"
_ZERO = "0_*"
# Each '_' run has one place to go (never `_*[-+]?_*`: a long run of '_' would be split
# every way before a mismatch fails it, seconds for 10 kB in Python's re).
_EXP = f"[eE]{_U}(?:[-+]{_U})?(?:{_DIGIT})+"


def _mantissa(digit: str) -> str:
    return f"(?:(?:{digit})+(?:\\.{_U}(?:{digit})*)?|\\.{_U}(?:{digit})+)"


def _text(*bodies: str, nonzero: bool = False) -> dict[str, str]:
    # a non-zero digit before any exponent; looked for once, before the leading blanks
    ahead = "(?=[^eE]*[1-9])" if nonzero else ""
    return {"type": "string", "pattern": f"^{ahead}\\s*(?:{'|'.join(bodies)})\\s*$"}


_ANY = f"{_mantissa(_DIGIT)}(?:{_EXP})?"
_PLUS = f"{_U}(?:\\+{_U})?"  # no sign, or +
_NEG_ZERO = f"{_U}-{_U}{_mantissa(_ZERO)}(?:{_EXP})?"  # -0 is 0
_WHOLE = f"(?:(?:{_DIGIT})+(?:\\.{_U}(?:{_ZERO})*)?|\\.{_U}(?:{_ZERO})+)"  # no fraction
_NONNEG_TEXT = _text(_PLUS + _ANY, _NEG_ZERO)
_POSITIVE_TEXT = _text(_PLUS + _ANY, nonzero=True)
_COUNT_TEXT = _text(f"{_PLUS}(?:{_WHOLE}|{_mantissa(_DIGIT)}{_EXP})", _NEG_ZERO)
_POSITIVE_COUNT_TEXT = _text(f"{_PLUS}(?:{_WHOLE}|{_mantissa(_DIGIT)}{_EXP})", nonzero=True)


def _number_schema(number: dict[str, object], text: dict[str, str]) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [number, text]})


_NUMBER = BeforeValidator(_a_number)
_COUNT = BeforeValidator(_a_count)
Count = Annotated[int, Field(ge=0, le=MAX_COUNT), _COUNT, _number_schema(
    {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}, _COUNT_TEXT)]
Rate = Annotated[float, Field(gt=0, le=MAX_COUNT, allow_inf_nan=False), _NUMBER, _number_schema(
    {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_COUNT}, _POSITIVE_TEXT)]
PerMillion = Annotated[float, Field(ge=0, allow_inf_nan=False), _NUMBER, _number_schema(
    {"type": "number", "minimum": 0}, _NONNEG_TEXT)]
Weight = Annotated[float, Field(ge=0, le=1000, allow_inf_nan=False), _NUMBER, _number_schema(
    {"type": "number", "minimum": 0, "maximum": 1000}, _NONNEG_TEXT)]
PositiveCount = Annotated[int, Field(ge=1, le=MAX_COUNT), _COUNT, _number_schema(  # a burst,
    {"type": "integer", "minimum": 1, "maximum": MAX_COUNT}, _POSITIVE_COUNT_TEXT)]  # a revision

# An instant with its offset, as pydantic reads one: RFC 3339 (`2026-01-01T00:00:00Z`), and
# what pydantic reads besides: a space, `_` or `t` for `T`, no seconds, `+0100`, a Unix time in
# seconds (a number, or its digits as text). Not in the pattern: a day past its month's end.
_DATE = "[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9](?::[0-5][0-9](?:[.,][0-9]+)?)?"
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):?[0-5][0-9])"
TIMESTAMP_PATTERN = f"^{_DATE}[Tt _]{_TIME}{_OFFSET}$"
Timestamp = Annotated[AwareDatetime, WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": TIMESTAMP_PATTERN},
              {"type": "number"}, {"type": "string", "pattern": "^[-+]?[0-9]+(?:\\.[0-9]+)?$"}],
    "description": "an instant with its offset, RFC 3339: 2026-01-01T00:00:00Z"})]

# pydantic's lax bool: YAML 1.2 (an editor's) reads `yes` as text, which the loader takes.
_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0")
_ANY_CASE = "|".join("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in w)
                     for w in _BOOL_WORDS)
Flag = Annotated[bool, WithJsonSchema({"anyOf": [
    {"type": "boolean"}, {"enum": [0, 1]}, {"type": "string", "pattern": f"^(?:{_ANY_CASE})$"}]})]
