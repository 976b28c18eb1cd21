"""Example policies built on `DefaultPolicy`; each module's docstring says how to select it."""
