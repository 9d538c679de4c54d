"""The lab's own tests: their fixture plugins and hypothesis profiles.

The tests are laid out like ``lab/``: ``tests/runtime/`` tests ``lab.runtime``,
``tests/evidence/`` ``lab.evidence`` and so on; tests of the top-level modules (and of
the repository's layout as a whole) sit in ``tests/`` itself. What they share lives
in ``tests/support/``: plain modules imported as ``tests.support.<name>``, and the
fixture plugins below.

Hypothesis: ``ci`` (the default) is bounded and derandomized, so a run is
reproducible and the whole fuzz suite stays well under a minute on two cores.
``long`` is for a deliberate soak:
``HYPOTHESIS_PROFILE=long pytest tests/runtime/test_admission_fuzz.py``. Neither keeps
an example database, so nothing is written into the tree.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Fixture plugins: ``make_key`` (a fresh Ed25519 key pair as the PEM files the lab reads).
pytest_plugins = ["tests.support.keys"]

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", parent=settings.get_profile("ci"), max_examples=10_000, derandomize=False
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
