"""structlog JSON logs. Never log a secret or prompt text: only ids, codes and counts."""

from __future__ import annotations

import logging
import sys

import structlog

log = structlog.get_logger("gateway")


class _Stderr:
    """Whatever sys.stderr is at the time of writing (it may be replaced after configure)."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(level: str = "info", cache: bool = True) -> None:
    """JSON lines on stderr. `cache=False` for a one-shot command: a logger cached on first
    use keeps this configuration for the process's life (the services want that; a command
    run in-process, as the tests run them, must leave the configuration replaceable)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level(level)),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=cache,
    )
    _LIBRARIES.setLevel(max(logging.WARNING, _level(level)))
    root = logging.getLogger()
    if _LIBRARIES not in root.handlers:
        root.addHandler(_LIBRARIES)


def _level(name: str) -> int:
    return logging.getLevelNamesMapping().get(name.upper(), logging.INFO)


# What libraries log through the standard library (aiokafka: `Unable connect to ...`,
# asyncio: a task's unretrieved exception), at warning and above as before, but as the same
# JSON lines, with their logger's name: a bare text line among them breaks a log pipeline.
_LIBRARIES = logging.StreamHandler(_Stderr())
_LIBRARIES.setFormatter(structlog.stdlib.ProcessorFormatter(
    foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                       structlog.processors.TimeStamper(fmt="iso", utc=True)],
    processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]))
