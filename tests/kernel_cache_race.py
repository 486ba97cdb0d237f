"""One process of tests/test_kernel_cache.py: two of these compile different Adam kernel
variants into one fresh Numba cache at the same time, forced through the worst
interleaving of Numba's cache writes; a third loads both variants from that cache and
checks each against the reference backend.

Usage: ``python kernel_cache_race.py ROLE FLAGS_DIR`` with NUMBA_CACHE_DIR set; ROLE is
``first`` (compiles Adam), ``second`` (compiles Adam with amsgrad) or ``check``.

The forced order, for saves of a new entry into a cache index whose name contains "adam"
(Numba's ``IndexDataCacheFile.save``: read the index, write the index with the new entry
under the first free data-file name, write the data file): both processes read, then
``first`` writes its index, ``second`` writes its index and its data, ``first`` writes its
data.  Were both variants' entries in one index they would both take data file 1, the
index would end with ``second``'s entry and the file with ``first``'s code.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numba.core.caching as caching
import torch

import bf16opt

ROLE, FLAGS = sys.argv[1], Path(sys.argv[2])
OTHER = {"first": "second", "second": "first"}.get(ROLE)
CONFIGS = {"first": {}, "second": {"amsgrad": True}}


def signal(name: str) -> None:
    (FLAGS / name).touch()


def wait(name: str) -> None:
    deadline = time.monotonic() + 300
    while not (FLAGS / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{ROLE}: gave up waiting for {name}")
        time.sleep(0.01)


def forced(cache_file) -> bool:
    return OTHER is not None and "adam" in cache_file._index_name


def install_forced_order() -> None:
    save, load_index = caching.IndexDataCacheFile.save, caching.IndexDataCacheFile._load_index
    save_index, save_data = caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data

    def saving(self, key, data):
        if not forced(self):
            return save(self, key, data)

        def loaded():
            overloads = load_index(self)
            signal(f"loaded-{ROLE}")
            wait(f"loaded-{OTHER}")
            return overloads

        self._load_index = loaded
        try:
            return save(self, key, data)
        finally:
            del self._load_index

    def index_saved(self, overloads):
        if forced(self) and ROLE == "second":
            wait("index-first")
        save_index(self, overloads)
        if forced(self) and ROLE == "first":
            signal("index-first")

    def data_saved(self, name, data):
        if forced(self) and ROLE == "first":
            wait("data-second")
        save_data(self, name, data)
        if forced(self) and ROLE == "second":
            signal("data-second")

    caching.IndexDataCacheFile.save = saving
    caching.IndexDataCacheFile._save_index = index_saved
    caching.IndexDataCacheFile._save_data = data_saved


def step_bits(backend: str, options: dict) -> list:
    """Params and state of two Adam steps on one bf16 param, as int16 bit patterns (two: a third
    would compile the step cache's helpers too, in every process with its fresh cache)."""
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(300, generator=gen).bfloat16())
    opt = bf16opt.Adam([param], lr=1e-2, precision="bf16", backend=backend, **options)
    for _ in range(2):
        param.grad = torch.randn(300, generator=gen).bfloat16()
        opt.step()
    tensors = [param.detach()] + [v for k, v in sorted(opt.state[param].items()) if k != "step"]
    return [t.view(torch.int16).clone() if t.element_size() == 2 else t.view(torch.int32).clone() for t in tensors]


if __name__ == "__main__":
    if ROLE == "check":
        for options in CONFIGS.values():
            expected, got = step_bits("reference", options), step_bits("numba", options)
            if not all(torch.equal(a, b) for a, b in zip(expected, got)):
                sys.exit(f"the cached kernel of Adam {options} does not compute Adam {options}")
        print("both variants compute their own update")
    else:
        install_forced_order()
        step_bits("numba", CONFIGS[ROLE])
        print(f"{ROLE}: compiled ({os.getpid()})")
