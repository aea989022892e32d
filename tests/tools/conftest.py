"""Marks for tests/tools/test_heads.py, kept here while that file changes on another branch.

Training exit heads takes tens of seconds on a 2-core CPU: the tests that train (the module fixture
`trained`, 150 steps, and the direct training test) are `slow`. Once the other branch has merged, these
marks belong in test_heads.py itself (`@pytest.mark.slow`) and this file can go.
"""

import pytest

TRAINS_HEADS = {"test_training_reports_decreasing_loss_and_leaves_the_model_unchanged"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name != "test_heads.py" or item.path.parent.name != "tools":
            continue
        if "trained" in getattr(item, "fixturenames", ()) or item.name in TRAINS_HEADS:
            item.add_marker(pytest.mark.slow)
