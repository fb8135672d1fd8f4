"""User-facing errors: one line each, naming what is wrong and how to fix it."""

from __future__ import annotations


class ConfigError(Exception):
    """A user's config, file or command line is wrong. Carries one message per problem."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class TrainingFailed(Exception):
    """The training itself failed (exit status 1), as opposed to a bad config (status 2)."""


class Interrupted(Exception):
    """The user stopped the run (Ctrl-C): exit status 130, with the checkpoint the same command resumes from."""


class ExplainedFailure(RuntimeError):
    """A failure during training whose message already says what happened and what to try
    (an out-of-memory, unlike devices): shown as one line, without a traceback."""


def first_line(exc: BaseException) -> str:
    """``Type: the first line of its message``: a library's error as one line of ours."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
