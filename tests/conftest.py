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


def pytest_configure(config):
    """Pin the run seed (``tests/gpu_sample.py``) before xdist starts its workers, which inherit
    the environment: every worker then collects the same part of the sweeps
    (``tests/sweeps.py``), even across midnight."""
    import gpu_sample

    os.environ.setdefault(gpu_sample.SEED_VARIABLE, str(gpu_sample.sample_seed()))


def pytest_report_header(config):
    import gpu_sample
    import sweeps

    if sweeps.sweeps_everything():
        return f"configuration sweeps: every item (${sweeps.SWEEP_VARIABLE}=all)"
    seed = gpu_sample.sample_seed()
    return (f"configuration sweeps: part {sweeps.run_part()} of {sweeps.PARTS} (seed {seed}; repeat with "
            f"{gpu_sample.SEED_VARIABLE}={seed}, every item with {sweeps.SWEEP_VARIABLE}=all)")
