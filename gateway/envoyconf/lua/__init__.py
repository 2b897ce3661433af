"""Lua filters that run inside Envoy, shipped as package data (see metering.lua's contract)."""

from __future__ import annotations

from importlib import resources


def source(name: str = "metering.lua") -> str:
    """The text of a Lua filter in this package, e.g. for the Lua filter's inline source."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
