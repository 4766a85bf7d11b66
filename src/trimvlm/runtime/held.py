"""Reference-counted changes to objects that runs in several threads share (a module's config, a modeling
module's function): the first context in on a key makes the change, the last one out undoes it, so runs that
overlap never undo each other's change mid-run."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable


class Held:
    """One table of held changes, with its lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Hashable, list] = {}  # key -> [undo, contexts open]

    @contextlib.contextmanager
    def holding(self, key: Hashable, change: Callable[[], Callable[[], None]]):
        """Inside: the change `change()` made (it returns its undo) for the first context on `key`; the undo runs
        when the last context on `key` closes."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                entry = self._held[key] = [change(), 0]
            entry[1] += 1
        try:
            yield
        finally:
            with self._lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._held[key]
                    entry[0]()
