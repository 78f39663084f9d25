#!/usr/bin/env bash
# Install r2comm (and what it needs) into a virtualenv, then run the test suite.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
