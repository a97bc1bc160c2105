"""Doctests in src/ and docs/ see ``tr`` (``import tailrace as tr``) like the examples."""

import pytest

import tailrace


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["tr"] = tailrace
