"""What a test changes of the process's environment is put back (``process_state``)."""

from __future__ import annotations

import os

from tests.conftest import environment, kept_environment


def test_what_a_block_changes_of_the_environment_is_put_back() -> None:
    """A variable added is deleted again, one changed or deleted holds its value again, and
    pytest's own ``PYTEST_CURRENT_TEST`` is left out of the comparison."""
    before = environment()
    assert "PYTEST_CURRENT_TEST" in os.environ
    assert "PYTEST_CURRENT_TEST" not in before
    with kept_environment():
        os.environ["LIFECYCLE_TEST_PROCESS_STATE"] = "1"
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "7"
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert environment() != before
    assert environment() == before
    assert "LIFECYCLE_TEST_PROCESS_STATE" not in os.environ
