"""The daemon's logs: one event per line on stderr, JSON (default) or console.

Every line carries ``timestamp`` (ISO, UTC), ``level``, ``logger`` and ``event``, plus
the event's key-values and, for an error with a traceback, ``exception``. kvtether's
structlog loggers and the standard library's (``asyncio``, ``grpc``, ``redis``,
Python warnings) go through the same processors: structlog's
``ProcessorFormatter`` on the root logger's one handler, so a log shipper parses one
format. gRPC's C core writes its own messages (``GRPC_VERBOSITY``) outside Python.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import Processor

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
LOG_FORMATS = ("json", "console")


def _renderer(log_format: str, stream: TextIO) -> list[Processor]:
    if log_format == "json":
        return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    # Plain tracebacks: the same text whether or not rich is installed.
    return [structlog.dev.ConsoleRenderer(colors=stream.isatty(),
                                          exception_formatter=structlog.dev.plain_traceback)]


def configure_logging(level: str = "info", log_format: str = "json",
                      stream: TextIO | None = None) -> None:
    """Route structlog and standard-library logging to ``stream`` (stderr) in
    ``log_format``, dropping events below ``level``. Replaces the root logger's
    handlers: call once, at start-up."""
    if level not in LEVELS:
        raise ValueError(f"log level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format: expected one of {', '.join(LOG_FORMATS)}, "
                         f"got {log_format!r}")
    out = stream if stream is not None else sys.stderr
    # What a line gets whichever library logged it.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *_renderer(log_format, out)],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(LEVELS[level])
    # DeprecationWarning and friends as log lines, not bare text on stderr.
    logging.captureWarnings(True)

