"""A run name is checked whole: ``$`` in a pattern also matches before a final newline, so
``"r\\n"`` once passed the check and named a folder ending in a newline."""

from __future__ import annotations

import pytest

from hooks.store.rows import validate_run_name
from hooks.store.store import RunStoreError


@pytest.mark.parametrize("name", ["r\n", "run-1\n", "a\r", "a\nb"])
def test_a_name_with_a_line_break_is_refused(name):
    with pytest.raises(RunStoreError, match="invalid run name"):
        validate_run_name(name)


def test_a_name_of_the_allowed_characters_passes_as_it_is():
    assert validate_run_name("run-1.a_b=c+d") == "run-1.a_b=c+d"
    assert validate_run_name("a" * 100) == "a" * 100
    with pytest.raises(RunStoreError):
        validate_run_name("a" * 101)
