"""The CLI's rich console: its width decided at each print, $COLUMNS first, so a table fits where it goes."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console, ConsoleDimensions

#: The width of a table written to a file, a pipe or a CI log when $COLUMNS does not say one: wide enough
#: that a table of decisions is not folded into a column a word wide.
WIDE = 160


def columns() -> int | None:
    """$COLUMNS when it is a positive number, else None."""
    text = os.environ.get("COLUMNS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


class CliConsole(Console):
    """A rich Console whose width is read when it prints, not when it was made (a module's console is made at
    import): $COLUMNS where set (a pipe too: ``COLUMNS=100 watchdog history | less``), the terminal's width on a
    terminal, else :data:`WIDE`. Text lines are not folded at the width (``soft_wrap``): tables are. No markup: what is printed carries run ids, paths and messages from files, and
    a ``[/x]`` in one prints as it is."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("markup", False)
        # Lines of text are never folded (a path or a command broken across lines cannot be copied or grepped);
        # tables still fit the width.
        kwargs.setdefault("soft_wrap", True)
        super().__init__(**kwargs)
        self._width = None  # (rich fixes $COLUMNS at construction otherwise)

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        width = columns() or (None if self.is_terminal else WIDE)
        return dims if width is None else ConsoleDimensions(width, dims.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]
