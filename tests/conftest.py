"""Test-suite settings shared by every test file.

Hypothesis profiles: ``ci`` (the default, used by ``make test``) runs a bounded number of
examples from a fixed seed, so that the suite is repeatable and stays within its time budget;
``fuzz`` (``make fuzz``) runs many more. A failing example is printed by hypothesis with the
``@reproduce_failure`` line needed to rerun it alone.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", derandomize=True, max_examples=25, **_COMMON)
settings.register_profile("fuzz", derandomize=False, max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def serve(**options):
    """``zerodp ui``'s server (``make_server`` options) on a free loopback port, in a thread,
    until the generator is closed: ``yield from serve(...)`` in a fixture."""
    from zerodp.ui.server import make_server, serve_in_thread

    srv = make_server(port=0, **options)
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def server():
    """The page's server without a trace, for one test module."""
    yield from serve()
