"""Hypothesis profiles for the lab's own tests.

``ci`` (the default) is bounded and derandomized, so a run is reproducible and
the whole fuzz suite stays well under a minute on two cores. ``long`` is for a
deliberate soak: ``HYPOTHESIS_PROFILE=long pytest tests/test_admission_fuzz.py``.
Neither keeps an example database, so nothing is written into the tree.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
