"""A `store` fixture: the log store on a fresh SQLite file, opened once for the test and closed after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks.core.store import Store


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path}/store.db") as opened:
        yield opened
