"""What the package's objects that hold something (a run's query engine, a daemon connection, a
progress bar) share: ``with`` closes them."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with obj:`` calls ``obj.close()`` at the end of the block, however it ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
