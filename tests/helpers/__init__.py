"""Shared test helpers, importable from every tier (pytest's ``pythonpath = ["tests"]``): ``families`` (the family
registry and its tiny models), ``sync_detector``, ``strategies`` (hypothesis), ``references`` (plain-Python policy
references)."""
