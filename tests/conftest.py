"""Shared test settings: hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (what ``make test`` sets) is derandomized so CI is repeatable;
``dev`` explores new examples each run.  No deadline: Numba compiles on first call.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("dev", deadline=None, max_examples=50,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
