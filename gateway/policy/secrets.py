"""API-key secrets: `sk-gw-<key_id>-<43 base64url chars>` (256 bits); only SHA-256 is stored."""

from __future__ import annotations

import base64
import hashlib
import secrets

PREFIX = "sk-gw-"
# Key ids are public (logs, headers, events) and sit inside the secret between two '-':
# letters, digits and '_' only, so the id can always be read back out of a secret.
KEY_ID_RULE = ("1 to 64 letters, digits or '_' (no '-': it separates the parts of "
               "sk-gw-<key_id>-<random>)")
KEY_ID_PATTERN = r"^[A-Za-z0-9_]{1,64}$"


def new_secret(key_id: str) -> str:
    token = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return f"{PREFIX}{key_id}-{token}"


def random_part(secret: str) -> str:
    """The 43 random characters of a secret this module made: everything after
    `sk-gw-<key_id>-`. Split at the first '-' after the prefix (key ids have none), never
    the last: base64url text has '-' too."""
    return secret.removeprefix(PREFIX).split("-", 1)[1]


def digest(secret: str | bytes) -> bytes:
    """The lookup key. The secret is hashed whole, so keys the hub minted in other formats work."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).digest()


def new_key_id() -> str:
    return "key_" + secrets.token_hex(4)
