"""The chip's own tests (see conftest.py); a package, so its conftest is not the suite's ``conftest``."""
