"""Compiled engine (engine.pyx; its declarations in engine.pxd), the verbs transport (verbs.pyx,
where libibverbs exists) and, in development and test builds only, the tests' hooks
(testing.pyx: setup.py)."""
