"""Compiled engine (engine.pyx) and the TCP transport's connection set-up (tcp.py)."""
