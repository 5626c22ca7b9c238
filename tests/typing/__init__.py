"""Type checks: files that mypy must accept or refuse, run from the tests here."""
