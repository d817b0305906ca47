"""Fixtures for the tracer tests (helpers live in tracer_helpers.py)."""

from __future__ import annotations

import pytest

from tracer_helpers import make_gpt
from pagemem.models import GPT


@pytest.fixture
def tiny() -> GPT:
    return make_gpt()
