"""Errors a user can act on.

Everything that is the user's to fix (a typo in a config, a missing folder, a corrupt image, a fraction that
does not fit the card) is raised as a `UserError` with one line that names the file or key and the fix. The CLI
prints that line and exits with the error's code; anything else is a bug in dittrain and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input; `str(err)` is the one line the CLI prints, after `label`."""

    exit_code = 1
    label = "error: "  # a requested stop (`Interrupted`) is no error and prints none


class ConfigError(UserError):
    """A config file or `--set` override that does not validate. Exit code 2, like a usage error."""

    exit_code = 2


class NonFiniteLossError(UserError):
    """A NaN or inf loss; raised before any weight changes."""

    exit_code = 3


class NonFiniteWeightsError(UserError):
    """Trained weights that became NaN or inf under a finite loss (a non-finite gradient); raised before they
    are saved, so the newest checkpoint stays the last good one."""

    exit_code = 3


class Interrupted(UserError):
    """A stop the user asked for (Ctrl-C, SIGTERM): no error, so the CLI prints its line without "error:", and
    exits with 128 + the signal's number as shells report a process the signal ended (130 for SIGINT, 143 for
    SIGTERM)."""

    label = ""
    exit_code = 130

    def __init__(self, message: str, signal_name: str = "SIGINT") -> None:
        super().__init__(message)
        import signal

        self.signal_name = signal_name
        self.exit_code = 128 + getattr(signal.Signals, signal_name, signal.SIGINT).value

    @staticmethod
    def signal_of(e: BaseException) -> str:
        """The signal a KeyboardInterrupt stands for: the name a handler raised it with (faults.StopFlag), else
        SIGINT (Python's own Ctrl-C)."""
        name = e.args[0] if e.args and isinstance(e.args[0], str) else ""
        return name if name.startswith("SIG") else "SIGINT"
