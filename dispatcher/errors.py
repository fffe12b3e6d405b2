"""Errors that end a run with a one-line message and a fixed exit code."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes (contracts §10); job scripts rerun the command on RESUMABLE."""

    DONE = 0
    UNEXPECTED = 1
    BAD_INPUT = 2
    RESUMABLE = 75


class DispatcherError(Exception):
    """An error whose message is shown to the operator as is."""

    exit_code: ExitCode = ExitCode.UNEXPECTED


class ConfigError(DispatcherError):
    """Bad configuration or input, detected before anything is dispatched."""

    exit_code = ExitCode.BAD_INPUT


class OutputWriteError(DispatcherError):
    """An output file could not be written; the run stops, what is written stays valid."""

    exit_code = ExitCode.UNEXPECTED
