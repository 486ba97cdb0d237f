"""Numba's on-disk cache of the chunk functions, shared by processes that compile at once.

Several processes compiling kernels into one fresh cache is the normal case (pytest-xdist
workers, DDP ranks on first use).  Numba saves an entry by reading the function's index,
adding the entry under the first unused data-file number and writing index and data
separately, so two processes saving different entries of one index at once can leave an
entry that names the other's machine code.  ``chunks.chunk_compiler`` gives every
configuration an index of its own; ``kernel_cache_race.py`` forces the worst interleaving.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

RACE = Path(__file__).with_name("kernel_cache_race.py")


def test_processes_compiling_different_variants_at_once_leave_each_its_own_kernel(tmp_path):
    from numba.core.caching import IndexDataCacheFile

    missing = [name for name in ("save", "_load_index", "_save_index", "_save_data")
               if not hasattr(IndexDataCacheFile, name)]
    if missing:
        pytest.skip(f"this numba's IndexDataCacheFile lacks {missing}: the forced interleaving cannot be installed")
    cache, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}

    def run(role):
        return subprocess.Popen([sys.executable, str(RACE), role, str(flags)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    writers = [run("first"), run("second")]
    for writer in writers:
        out, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err[-3000:]
    def adam_files():
        return {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in cache.rglob("adam*")}

    written = adam_files()

    check = run("check")
    out, err = check.communicate(timeout=600)
    assert check.returncode == 0, (out + err)[-3000:]
    assert "both variants compute their own update" in out
    # the check loaded both kernels from the cache: it compiled and saved no Adam kernel
    assert adam_files() == written
    assert len([name for name in written if name.endswith(".nbi")]) == 2, sorted(written)  # one index each
