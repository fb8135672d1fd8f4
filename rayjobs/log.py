"""The one printer: every line rayjobs shows a user goes through here.

Workers and the driver's progress lines start with ``[rayjobs]`` and go to stdout directly (Ray
Train's print patch would echo a ``print`` twice); the driver's own notes start with ``rayjobs:``.
A leaf: imports nothing of rayjobs.
"""

from __future__ import annotations

import sys


def log(message: str) -> None:
    """One progress line: ``[rayjobs] message`` on stdout, flushed."""
    sys.stdout.write(f"[rayjobs] {message}\n")
    sys.stdout.flush()


def warn(message: str) -> None:
    """One warning line: ``[rayjobs] warning: message`` on stdout, flushed."""
    log(f"warning: {message}")


def alert(message: str) -> None:
    """A driver's warning that must not drown in progress lines: ``rayjobs: warning: message`` on stderr."""
    print(f"rayjobs: warning: {message}", file=sys.stderr, flush=True)


def note(message: str) -> None:
    """One line of the driver's own: ``rayjobs: message`` on stdout, flushed."""
    print(f"rayjobs: {message}", flush=True)


def error(message: str, prefix: str = "error") -> None:
    """The one-line failure of a command: ``rayjobs: error: message`` on stderr."""
    print(f"rayjobs: {prefix}: {message}", file=sys.stderr, flush=True)
