"""Hypothesis profiles of the fuzz suite.

``make test`` runs each property with a small example budget (profile ``ci``);
``make fuzz`` (tests/fuzz/run.py) runs rounds of the ``fuzz`` profile with fresh
seeds for a given number of minutes.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("ATTNKIT_FUZZ_PROFILE", "ci"))
