"""Lua filters that run inside Envoy, shipped as package data (see metering.lua's contract).

A filter's `--@CONTRACT@` line is replaced, when rendered, by Lua locals holding the names it
shares with the sidecar (gateway/envoy_contract.py): the Lua never spells them itself.
"""

from __future__ import annotations

from importlib import resources

from gateway import envoy_contract as contract

MARKER = "--@CONTRACT@"
# Lua local -> its value, each written as `local NAME = "value"`.
CONSTANTS = {
    "AUTHZ_NS": contract.AUTHZ_NAMESPACE,
    "STREAM_NS": contract.STREAM_NAMESPACE,
    "USAGE_NS": contract.USAGE_NAMESPACE,
    "SPLICE": contract.SPLICE,
    "SPLICE_AT": contract.SPLICE_AT,
    "SPLICE_CUT": contract.SPLICE_CUT,
    "HIDE_USAGE": contract.HIDE_USAGE,
    "HIDE_CONTINUOUS": contract.HIDE_CONTINUOUS,
    "PROMPT_TOKENS": contract.PROMPT_TOKENS,
    "COMPLETION_TOKENS": contract.COMPLETION_TOKENS,
    "TOTAL_TOKENS": contract.TOTAL_TOKENS,
    "CACHED_TOKENS": contract.CACHED_TOKENS,
    "REASONING_TOKENS": contract.REASONING_TOKENS,
    "CACHE_READ_INPUT_TOKENS": contract.CACHE_READ_INPUT_TOKENS,
    "CACHE_CREATION_INPUT_TOKENS": contract.CACHE_CREATION_INPUT_TOKENS,
    "SERVED_MODEL": contract.SERVED_MODEL,
    "CONTENT_EVENTS": contract.CONTENT_EVENTS,
    "CONTENT_CHARS": contract.CONTENT_CHARS,
    "STREAM_DONE": contract.STREAM_DONE,
    "STREAM_FAILED": contract.STREAM_FAILED,
    "FIRST_CONTENT_US": contract.FIRST_CONTENT_US,
}


def _constants() -> str:
    for value in CONSTANTS.values():  # plain names: no Lua string escapes needed
        assert value.isascii() and value.isprintable() and '"' not in value and "\\" not in value
    return "\n".join(f'local {name} = "{value}"' for name, value in CONSTANTS.items())


def source(name: str = "metering.lua") -> str:
    """The text of a Lua filter in this package, its contract names filled in, e.g. for the
    Lua filter's inline source."""
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return text.replace(MARKER, _constants(), 1) if MARKER in text else text
