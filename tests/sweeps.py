"""Which part of a configuration sweep one run of the suite compiles.

The sweeps over every storage plan (``test_numba_backend.py``, ``test_numba_quality.py``) and
over every CUDA instantiation (``test_cuda_compile.py``) compile each configuration cold: a
Numba chunk function of about a second of one core, an NVRTC program of several.  All of them
on every run would keep the suite over its ten minutes on two cores, so a run takes one of
:data:`PARTS` parts:

* the items whose key hashes to the run seed modulo :data:`PARTS` (the seed is
  ``tests/gpu_sample.py``'s: today's date as YYYYMMDD unless ``$BF16OPT_GPU_SAMPLE_SEED`` is
  set), so the runs of consecutive days take the parts in turn, and a failing run repeats with
  its seed;
* plus the items every run must check (``always``): the plans of the named presets on
  bfloat16 params and of the fp32 preset on float32 params, which are what most users run
  (the presets' other float32- and float16-param plans take their turn with the rest; every
  run still checks each preset on float16 params end to end, in ``test_numba_backend.py``
  and ``test_numba_quality.py``);
* ``$BF16OPT_SWEEP=all`` runs every item (do so after changing a kernel or ``storage.py``).

``conftest.py`` pins the seed for the run's workers and names the part in the report header.
"""

from __future__ import annotations

import os
import zlib

import gpu_sample
import torch

from bf16opt.precision import PRESETS, plan_for

SWEEP_VARIABLE = "BF16OPT_SWEEP"
#: how many parts a sweep is cut into: one per run
PARTS = 6


def sweeps_everything(environ=os.environ) -> bool:
    """Whether this run sweeps every item (``$BF16OPT_SWEEP=all``)."""
    value = environ.get(SWEEP_VARIABLE, "").strip().lower()
    if value not in ("", "all"):
        raise ValueError(f"{SWEEP_VARIABLE} must be 'all' or unset, got {value!r}")
    return value == "all"


def run_part(environ=os.environ, parts: int = PARTS) -> int:
    """Which part (0 to ``parts`` - 1) this run sweeps: the run seed modulo ``parts``."""
    return gpu_sample.sample_seed(environ) % parts


def todays_part(items, key=str, always=lambda item: False, environ=os.environ, parts: int = PARTS) -> list:
    """The ``items`` this run sweeps, in their order: those ``always`` keeps, and those whose
    ``key`` (a string, stable from run to run) hashes to :func:`run_part` (of ``parts``)."""
    items = list(items)
    if sweeps_everything(environ):
        return items
    part = run_part(environ, parts)
    return [item for item in items if always(item) or zlib.crc32(key(item).encode()) % parts == part]


#: the param dtype whose preset plans every run sweeps; on float32 params only the fp32 preset's
#: plan is kept (what users of float32 params run), the other presets' take their turn
ALWAYS_PARAM_DTYPE = torch.bfloat16


def preset_plans() -> set:
    """The plans of every named preset on :data:`ALWAYS_PARAM_DTYPE` params (each accepts
    them), and the fp32 preset's on float32 params."""
    return {plan_for(precision, ALWAYS_PARAM_DTYPE) for precision in PRESETS.values()} \
        | {plan_for(PRESETS["fp32"], torch.float32)}


def todays_plans(plans, plan_id) -> list:
    """The storage plans this run sweeps: the presets' (:func:`preset_plans`), and one part of
    the others."""
    presets = preset_plans()
    return todays_part(plans, key=plan_id, always=presets.__contains__)
