"""The bounds of ``dispatcher serve`` (contracts §12): what its memory and disk may
hold whatever its clients do, one validated model with units in the names.

Each flag bounds one thing a client could otherwise grow without end:

- ``--max-streams``: results streams open at once, daemon-wide (over it: 503).
- ``--stream-buffer-bytes``: what one stream holds unsent; the stream reads
  no more rows while its peer does not take them, and a chunk carries at
  most this many bytes of rows (one row bigger than it goes alone).
- ``--stream-idle-timeout-s``: a stream whose peer took nothing for this
  long is closed (the client resumes with ``after=``).
- ``--max-body-bytes``: one request's body (over it: 413).
- ``--max-body-bytes-in-flight``: bytes of request bodies in hand (read, not
  yet answered), daemon-wide, counted as they arrive.
- ``--body-timeout-s``: a request body not received whole this long after its
  headers is answered 408 and its connection closed.
- ``--header-timeout-s``: a connection that has not sent a whole request's
  headers this long after connecting (or after its last answer) is closed;
  with TLS, one whose handshake has not ended this long after connecting too.
- ``--max-job-rollouts``: rows × repeats of one job (over it: 400).
- ``--retain-settled-jobs``: settled jobs that keep a folder of their own in
  ``jobs/``; every this many are folded into one archive (``archive.py``).
- ``--max-job-bytes``: what one job materializes, (input bytes + rows × the
  bytes of the ``responses_create_params`` merged into each row) × repeats,
  what its files grow to at the least (over it: 413).
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dispatcher.errors import ConfigError

MIB = 1024 * 1024
MAX_JOB_BYTES = 1024 * 1024 * MIB


class ServeLimits(BaseModel):
    """The bounds of one ``dispatcher serve`` daemon."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_streams: int = Field(default=256, ge=1)
    stream_buffer_bytes: int = Field(default=256 * 1024, ge=4096)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    max_body_bytes: int = Field(default=256 * MIB, ge=1024)
    max_body_bytes_in_flight: int = Field(default=256 * MIB, ge=1024)
    body_timeout_s: float = Field(default=120.0, gt=0)
    header_timeout_s: float = Field(default=30.0, gt=0)
    max_job_rollouts: int = Field(default=1_000_000, ge=1)
    # Bounded: a job of more could not be held by any disk it would run on.
    max_job_bytes: int = Field(default=16 * 1024 * MIB, ge=1, le=MAX_JOB_BYTES)
    # Settled jobs with folders of their own; every this many are folded into an archive.
    retain_settled_jobs: int = Field(default=1000, ge=1)

    @model_validator(mode="after")
    def _a_body_fits(self) -> ServeLimits:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                "--max-body-bytes-in-flight: must be at least --max-body-bytes "
                "(else a body of the largest size could never be read)"
            )
        return self


# The keys of ``serve`` that are not ``RunSettings``': its flags of its own and its
# bounds. Like `run`'s they come from the config file < DISPATCHER_* < flags
# (``config.layered``); `run` leaves them to it.
SERVE_OWN_KEYS = frozenset(
    {
        "listen",
        "state_dir",
        "max_off_policy_steps",
        "api_token_file",
        "allow_unauthenticated",
        "tls_cert",
        "tls_key",
        "input_root",
        "gym_head_server_wait_s",
    }
)
SERVE_KEYS = SERVE_OWN_KEYS | frozenset(ServeLimits.model_fields)


# flag -> (help, metavar): the defaults are the model's, shown from it.
_FLAGS: dict[str, tuple[str, str]] = {
    "--max-streams": ("results streams open at once; more answer 503", "N"),
    "--stream-buffer-bytes": ("bytes one results stream holds unsent", "BYTES"),
    "--stream-idle-timeout-s": ("close a results stream whose client took nothing this long", "S"),
    "--max-body-bytes": ("one request body at most; bigger answers 413", "BYTES"),
    "--max-body-bytes-in-flight": ("bytes of request bodies in hand, daemon-wide", "BYTES"),
    "--body-timeout-s": ("answer 408 to a request body not received whole this long", "S"),
    "--header-timeout-s": ("close a connection that sent no whole request headers this long", "S"),
    "--max-job-rollouts": ("rows x repeats of one job at most; more answers 400", "N"),
    "--max-job-bytes": (
        "(input bytes + rows x the job's responses_create_params) x repeats of one job at "
        "most; more answers 413",
        "BYTES",
    ),
    "--retain-settled-jobs": (
        "settled jobs kept in folders of their own; every N are folded into one archive",
        "N",
    ),
}


# The flags, in the order ``--help`` shows them.
SERVE_LIMIT_FLAGS = tuple(_FLAGS)


def add_serve_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``ServeLimits`` on ``serve``'s parser."""
    defaults = ServeLimits()
    for flag, (text, metavar) in _FLAGS.items():
        default = getattr(defaults, _key(flag))
        parser.add_argument(flag, metavar=metavar, help=f"{text} (default {default:g})")


def serve_limits(args: argparse.Namespace) -> ServeLimits:
    """The bounds the flags ask for; ``ConfigError`` (exit 2) naming a bad one."""
    values: dict[str, Any] = {}
    for flag in _FLAGS:
        raw = getattr(args, _key(flag), None)
        if raw is not None:
            values[_key(flag)] = _number(flag, raw)
    try:
        return ServeLimits(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = error["loc"][0] if error["loc"] else None
        message = str(error["msg"]).removeprefix("Value error, ")
        if where is None:
            raise ConfigError(message) from None
        flag = "--" + str(where).replace("_", "-")
        raise ConfigError(f"{flag} {values.get(str(where))!r}: {message}") from None


def _key(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _number(flag: str, raw: str) -> int | float:
    text = raw.strip()
    try:
        return float(text) if flag.endswith("-s") else int(text)
    except ValueError:
        kind = "a number of seconds" if flag.endswith("-s") else "an integer"
        raise ConfigError(f"{flag} {raw!r}: must be {kind}") from None
