"""`with` support for the harness's parts that start and stop (the control
plane, the whole local cluster)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class StartStop(ABC):
    """A part with `start` and `stop`: `with part:` starts it, and stops it
    however the block ends."""

    @abstractmethod
    def start(self) -> None:
        """Start the part; on failure, leave nothing running."""

    @abstractmethod
    def stop(self) -> None:
        """Stop what `start` started; safe to call more than once."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
