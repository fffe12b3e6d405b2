"""The loop's turns kept short while answers pour in: bytes read and calls woken,
each bounded per turn of the loop (``Http1Pool`` is a ``TurnBounds``)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from dispatcher.aio import wake

# What all connections together read in one turn of the loop before those that
# still have bytes wait for the next turn (``TurnBounds.took_in``).
READ_BYTES_PER_TURN = 2 * 1024 * 1024
# Calls woken by their answer in one turn of the loop; the others in the turns
# after, in the order their answers came (``TurnBounds.answered``).
ANSWERS_PER_TURN = 64


class Reader(Protocol):
    """A connection that may stop reading for the rest of a turn."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class TurnBounds:
    """Counts what one turn of the loop reads and wakes; past a bound, the rest
    waits for the next turn."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        # For ``took_in``: bytes read since the count last started again, and the
        # connections that wait for the next turn.
        self._turn_bytes = 0
        self._paused: list[Reader] = []
        # For ``answered``: calls woken in this turn, and those that wait for the next.
        self._turn_answers = 0
        self._waking: deque[asyncio.Future[None]] = deque()
        # ``_next_turn`` is due at the next turn (both bounds start again there).
        self._turn_due = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def took_in(self, conn: Reader, size: int) -> None:
        """Count bytes read; past ``READ_BYTES_PER_TURN`` in this turn of the loop,
        each connection that reads waits for the next turn.

        libuv reads every ready socket, several times over, in one turn (4 MB
        a turn with eight 2 MB answers waiting): sixteen agents answering
        20 MB at once kept the loop copying for 40 to 100 ms before any timer
        or other callback ran. Bounded, each turn copies a few megabytes and
        the answers arrive as fast, over more turns.
        (Pausing every connection still receiving, not only those that read,
        was measured to stall more: ``bench/big_rows.py``.)
        """
        self._turn_bytes += size
        if self._turn_bytes <= READ_BYTES_PER_TURN:
            return
        conn.pause_reading()
        self._paused.append(conn)
        self._next_turn_soon(self.loop)

    def answered(self, head: asyncio.Future[None]) -> None:
        """Wake the call whose answer's head is in: at most ``ANSWERS_PER_TURN``
        in one turn of the loop, the others in the turns after, first come first.

        An agent answers calls in waves (10,000 started within a second end
        together 10 s later): libuv reads every ready socket in one turn, and
        each call woken runs its rollout's next steps in the turn after. With
        thousands woken at once, that turn held every timer and stream for up
        to 90 ms with no GC pass in it (``bench/service.py --concurrency 10000
        --latency-s 10``). Bounded, the turns are short and as many answers
        are handled a second: the work is the same, spread over more turns.
        """
        if self._turn_answers < ANSWERS_PER_TURN:
            self._turn_answers += 1
            wake(head)
        else:
            self._waking.append(head)
        self._next_turn_soon(head.get_loop())

    def _next_turn_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._turn_due:
            self._turn_due = True
            loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """A new turn: the paused connections read again (the byte count starts
        again only after a pause: below the bound it carries over, which only
        brings a pause early) and the calls waiting to be woken are, in order."""
        self._turn_due = False
        if self._paused:
            paused, self._paused = self._paused, []
            self._turn_bytes = 0
            for conn in paused:
                conn.resume_reading()
        self._turn_answers = 0
        waking = self._waking
        for _ in range(min(len(waking), ANSWERS_PER_TURN)):
            self.answered(waking.popleft())
