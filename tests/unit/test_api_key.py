"""Reading the API key from request headers, and the format of the secrets we mint."""

from __future__ import annotations

import base64
import hashlib
import re

import pytest

from gateway.authz.request import api_key
from gateway.policy import secrets
from gateway.policy.schema import PolicyDoc

KEY = "sk-gw-key_7Hq2-AbC_dEf-123"


@pytest.mark.parametrize(("value", "expected"), [
    (f"Bearer {KEY}", KEY),
    (f"bearer {KEY}", KEY),
    (f"BEARER  {KEY}", KEY),  # extra spaces between scheme and key
    (f"  Bearer {KEY}  ", KEY),  # surrounding whitespace
    (f"Basic {KEY}", None),
    (f"Token {KEY}", None),
    (KEY, None),  # no scheme at all
    ("Bearer", None),
    ("Bearer ", None),
    ("Bearer    ", None),
    ("", None),
    (f"Bearer {KEY}, Bearer sk-gw-other", None),  # Envoy comma-merged duplicates
    (f"Bearer {KEY},Bearer sk-gw-other", None),
    (f"Bearer {KEY} extra", None),  # whitespace inside the key
    (f"Bearer {KEY}\r\nx-gateway-key-id: admin", None),  # CRLF injection
    (f"Bearer {KEY}\nx", None),
    (f"Bearer {KEY}\x00", None),
    (f"Bearer {KEY[:10]}\x07{KEY[10:]}", None),
    (f"Bearer {KEY[:10]}\t{KEY[10:]}", None),
    (f"Bearer {KEY[:10]}\x7f{KEY[10:]}", None),
    ("Bearer " + "a" * 10_240, None),  # 10 KB
])
def test_authorization_header(value: str, expected: str | None) -> None:
    assert api_key({"authorization": value}) == expected


def test_longest_accepted_key() -> None:
    assert api_key({"authorization": "Bearer " + "a" * 512}) == "a" * 512
    assert api_key({"authorization": "Bearer " + "a" * 513}) is None


@pytest.mark.parametrize(("value", "expected"), [
    (KEY, KEY),
    (f"  {KEY} ", KEY),
    ("", None),
    (f"{KEY}, {KEY}", None),
    (f"{KEY}\r\nx: y", None),
    ("a" * 10_240, None),
])
def test_x_api_key_header(value: str, expected: str | None) -> None:
    assert api_key({"x-api-key": value}) == expected


def test_x_api_key_used_only_when_authorization_absent() -> None:
    assert api_key({"authorization": f"Bearer {KEY}", "x-api-key": "sk-gw-other"}) == KEY
    # a malformed authorization is an answer in itself: no falling back to x-api-key
    assert api_key({"authorization": "Basic abc", "x-api-key": KEY}) is None
    assert api_key({"authorization": "", "x-api-key": KEY}) is None


def test_no_key_headers() -> None:
    assert api_key({}) is None
    assert api_key({"cookie": f"key={KEY}", "x-gateway-key-id": "alice"}) is None


SECRET_RX = re.compile(r"^sk-gw-(?P<key_id>[A-Za-z0-9_]+)-[A-Za-z0-9_-]{43}$")


@pytest.mark.parametrize("key_id", ["key_7Hq2", "demo", "a", "K" * 64])
def test_new_secret_format(key_id: str) -> None:
    secret = secrets.new_secret(key_id)
    m = SECRET_RX.fullmatch(secret)
    assert m is not None, secret
    assert m["key_id"] == key_id
    assert api_key({"authorization": f"Bearer {secret}"}) == secret  # readable back


def test_new_secrets_are_random_and_carry_256_bits() -> None:
    made = [secrets.new_secret("k") for _ in range(200)]
    assert len(set(made)) == 200
    for secret in made[:20]:
        token = secret.removeprefix("sk-gw-k-")
        assert len(base64.urlsafe_b64decode(token + "=")) == 32


def test_random_part_is_all_after_the_key_id_even_with_dashes_in_it() -> None:
    # base64url has '-': about half of all secrets carry one in their random part
    rand = "Ab-" + "x" * 38 + "-E"
    assert secrets.random_part(f"sk-gw-key_7Hq2-{rand}") == rand
    for secret in (secrets.new_secret("k") for _ in range(50)):
        assert len(secrets.random_part(secret)) == 43


def test_digest_is_sha256_of_the_whole_secret() -> None:
    secret = secrets.new_secret("key_7Hq2")
    assert secrets.digest(secret) == hashlib.sha256(secret.encode()).digest()
    assert secrets.digest(secret.encode()) == secrets.digest(secret)
    assert secrets.digest("test").hex() == (
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08")


def test_new_key_id_is_a_valid_policy_key_id() -> None:
    ids = {secrets.new_key_id() for _ in range(50)}
    assert len(ids) == 50
    for key_id in ids:
        assert re.fullmatch(r"key_[0-9a-f]{8}", key_id)
    sha = "0" * 64
    doc = PolicyDoc.model_validate({
        "teams": {"t": {}},
        "keys": {key_id: {"team": "t", "sha256": sha[:-2] + f"{i:02d}"}
                 for i, key_id in enumerate(ids)},
    })
    assert set(doc.keys) == ids
