"""The fuzz suite (a package, so that its conftest does not shadow tests/conftest.py; shared
helpers: tests/_oracle.py)."""
