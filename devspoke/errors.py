"""The local spoke's own exceptions, apart from the gateway's (gateway/errors.py): the mock
engine checks the gateway, so it shares none of its code."""

from __future__ import annotations


class ServiceError(RuntimeError):
    """A service could not be found, did not start, or died while starting."""


class RequestError(ValueError):
    """A request the mock engine rejects with 400, like a real OpenAI-compatible server."""


class Died(ConnectionResetError):
    """The mock engine stopped mid-generation on purpose; the connection is already gone."""
