"""The trainer's policy version V in service mode (contracts §12): the daemon's
``policy``, and waiting for it to move."""

from __future__ import annotations

import asyncio


class PolicyClock:
    """The trainer's current policy version V (contracts §12), and waiting for it to move."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._moved = asyncio.Event()

    def set(self, version: int) -> None:
        self.version = version
        self._moved.set()
        self._moved = asyncio.Event()

    async def reaches(self, version: int) -> None:
        """Wait until V ≥ ``version``."""
        while self.version < version:
            await self._moved.wait()
