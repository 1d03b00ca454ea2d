import os
import sys

import pytest

# Tests import their helpers (harness, toy) as top-level modules; ranks are forked from a server
# that must find them too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", "")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups off the markers
def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """``make test`` runs ``pytest -n 2 --dist loadgroup`` (pytest-xdist: two workers, one per
    core): the tests that share a module-scoped fixture (one launched run read by several
    tests) go to one worker together, so that run is launched once, not once per worker."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        shared = defs is not None and any(
            d.scope == "module" for ds in defs.name2fixturedefs.values() for d in ds
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
