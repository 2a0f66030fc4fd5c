"""What `inspect` writes to stderr while it runs: one progress line per step, and nothing
else that the table repeats or that the user cannot act on.

Without ``-v``:
- the compiler's own log (per-graph summaries, misses) is dropped: inspect compiles each
  stack several times, each compile logs its misses again, and the table lists each miss once;
- library warnings (torch's and transformers' log records, Python warnings raised outside
  this package, e.g. Dynamo's `lru_cache` warning on each trace of transformers' MoE code)
  are counted, and one line at the end says how many distinct ones were hidden;
- errors from any logger, and Python warnings raised in this package, are printed.

With ``-v`` every log record is printed, and each distinct Python warning once, between the
progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator

OWN_LOGGER = "fusion_compiler"
LIBRARY_LOGGERS = ("torch", "transformers")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _top(name: str) -> str:
    return name.split(".", 1)[0]


class Terminal:
    """Progress lines and the routing of logs and warnings to one stream (stderr by default)."""

    def __init__(self, verbose: bool, stream=None):
        self.verbose = verbose
        self.stream = stream if stream is not None else sys.stderr
        self.hidden: set[str] = set()  # distinct library warnings not shown
        self._shown: set[str] = set()  # distinct Python warnings shown under -v
        self._open_line = False  # a progress line waits for its time
        self._interrupted = False

    # -- output ------------------------------------------------------------------

    def write_line(self, text: str) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
            self._interrupted = True
        self.stream.write(text + "\n")
        self.stream.flush()

    @contextlib.contextmanager
    def progress(self, label: str) -> Iterator[list[str]]:
        """``label ... 3.2 s, <notes>`` on one line; the step appends its notes to the list.
        A log line printed during the step (``-v``) breaks the line: the time then comes
        on a line of its own, repeating the label."""
        self.write_line_open(f"{label} ...")
        notes: list[str] = []
        started = time.perf_counter()
        try:
            yield notes
        except BaseException:
            self._finish(label, f"failed after {time.perf_counter() - started:.1f} s")
            raise
        self._finish(label, ", ".join([f"{time.perf_counter() - started:.1f} s", *notes]))

    def write_line_open(self, text: str) -> None:
        if self._open_line:
            self.stream.write("\n")
        self.stream.write(text)
        self.stream.flush()
        self._open_line, self._interrupted = True, False

    def _finish(self, label: str, outcome: str) -> None:
        if self._open_line and not self._interrupted:
            self.stream.write(f" {outcome}\n")
            self.stream.flush()
            self._open_line = False
        else:
            self.write_line(f"{label}: {outcome}")

    # -- logs and warnings -------------------------------------------------------

    def _record(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.ERROR or self.verbose:
            # Messages that name their package already ("fusion_compiler: ...") keep it once.
            prefix = "" if message.startswith(_top(record.name)) else f"{record.name}: "
            self.write_line(prefix + message)
        elif _top(record.name) != OWN_LOGGER and record.levelno >= logging.WARNING:
            self.hidden.add(f"{record.name}: {message}")

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = f"{category.__name__} ({os.path.basename(filename)}:{lineno}): {str(message).rstrip()}"
        # The compiler's own warnings are not in the table: shown always.
        ours = os.path.abspath(filename).startswith(_PACKAGE_DIR)
        if not (self.verbose or ours):
            self.hidden.add(text)
        elif text not in self._shown:
            self._shown.add(text)
            self.write_line(text)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Route logs and Python warnings through this terminal for the block.

        - The compiler's logger: this terminal's handler alone, INFO under ``-v``.
        - torch's and transformers' top loggers: this terminal's handler in place of their
          stderr handler, and no propagation, so that their records reach the terminal
          whatever the root logger holds.
        - Their descendants and the root logger: the plain stderr handlers that torch,
          transformers and ``logging.basicConfig`` install are swapped for this terminal's.
        Other handlers (files, a test runner's capture) stay. With TORCH_LOGS set, torch's
        loggers are left alone: the user asked for those logs. All is restored on exit."""
        handler = _Handler(self)
        libraries = [name for name in LIBRARY_LOGGERS if not (name == "torch" and os.environ.get("TORCH_LOGS"))]
        touched = {}

        def take(logger: logging.Logger, propagate: bool | None = None) -> None:
            touched.setdefault(logger, (logger.handlers[:], logger.propagate, logger.level))
            logger.handlers = [h for h in logger.handlers if type(h) is not logging.StreamHandler] + [handler]
            if propagate is not None:
                logger.propagate = propagate

        own = logging.getLogger(OWN_LOGGER)
        take(own, propagate=False)
        own.handlers = [handler]
        own.setLevel(logging.INFO if self.verbose else logging.WARNING)
        for name in libraries:
            take(logging.getLogger(name), propagate=False)
        descendants = [
            logger for name, logger in list(logging.Logger.manager.loggerDict.items())
            if isinstance(logger, logging.Logger) and _top(name) in libraries
        ]
        for logger in [logging.getLogger(), *descendants]:
            if logger not in touched and any(type(h) is logging.StreamHandler for h in logger.handlers):
                take(logger)
        try:
            with warnings.catch_warnings():
                warnings.showwarning = self._warning
                yield
        finally:
            for logger, (handlers, propagate, level) in touched.items():
                logger.handlers, logger.propagate = handlers, propagate
                logger.setLevel(level)
            if self.hidden and not self.verbose:
                n = len(self.hidden)
                self.write_line(f"{n} library warning{'s' if n != 1 else ''} hidden; -v shows them")


class _Handler(logging.Handler):
    def __init__(self, terminal: Terminal):
        super().__init__(logging.NOTSET)
        self.terminal = terminal

    def emit(self, record: logging.LogRecord) -> None:
        # A record that propagates past two loggers holding this handler is said once.
        if getattr(record, "_inspect_terminal_seen", False):
            return
        record._inspect_terminal_seen = True
        try:
            self.terminal._record(record)
        except Exception:
            self.handleError(record)
