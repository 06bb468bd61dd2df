"""One lookup for the `--tool-call-parser` and `--reasoning-parser` values: a name, or "auto" for the model's
own parser (from its config and chat template)."""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

P = TypeVar("P")


class ParserRegistry(Generic[P]):
    def __init__(self, what: str, parsers: dict[str, type[P]],
                 default: Callable[[Any, str | None], str | None]) -> None:
        self.what, self.parsers, self.default = what, parsers, default

    def names(self) -> list[str]:
        return ["auto", *sorted(self.parsers)]

    def get(self, name: str) -> type[P]:
        try:
            return self.parsers[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of: {', '.join(self.names())}") from None

    def for_model(self, name: str, config: Any = None, chat_template: str | None = None) -> type[P] | None:
        """The parser `name` names; for "auto", the model's (None when it has none)."""
        if name == "auto":
            found = self.default(config, chat_template)
            return None if found is None else self.parsers[found]
        return self.get(name)
