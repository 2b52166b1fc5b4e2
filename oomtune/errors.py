"""The one project error (library code raises it; the CLI makes it one line and an exit code), and the one way
to put another exception in that line."""

from __future__ import annotations

BAD_INPUT = 2  # a broken model file, a wrong YAML key, a budget smaller than the weights
NO_FIT = 1  # valid input, but nothing fits / the config no longer fits
PEER_FAILED = 3  # a rank stopped because another rank failed or stopped answering (its collective broke)
OOM_RELAUNCH = 4  # FSDP ran out of memory: the halved plan is in the config, --resume continues (the launcher does)

MAX_COUNT = 2**31 - 1  # the most a count may be (a batch, a context, steps): a shape past it is no plan
MAX_MESSAGE = 2000  # characters of an error's line, at most: the rest is cut (a value echoed back can be megabytes)


class OomtuneError(Exception):
    """An error the user can act on: one line, naming the thing that is wrong."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message


class ModelFileError(OomtuneError):
    """The user's model file is missing, broken, or breaks the contract."""

    raised = False  # an exception the user's code raised (not a broken contract): the trial's sizes may be why


class ConfigError(OomtuneError):
    """A config file is missing, malformed, or has an unknown key / wrong type."""


def first_line(e: BaseException, empty: str | None = None) -> str:
    """An exception's first line, whole (never cut mid-sentence), with the next one where the first only
    introduces it ("Error(s) in loading state_dict for Net:"); for no message, `empty` or the type's name."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return empty if empty is not None else type(e).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def shown(value, limit: int = 60) -> str:
    """`repr(value)` as an error shows it: cut to `limit` characters, saying how long it was (a 401-digit number, a
    value expanded from YAML aliases)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    what = f"a {len(text):,}-digit number" if isinstance(value, int) else f"{len(text):,} characters"
    return f"{text[:limit // 2]}... ({what})"


def capped(message: str, limit: int = MAX_MESSAGE) -> str:
    """An error's line, at most `limit` characters: the cut says how much was left out."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit:,} more characters cut)"
