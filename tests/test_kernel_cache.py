"""Numba's on-disk cache of the chunk functions, shared by processes that compile at once.

Several processes compiling kernels into one fresh cache is the normal case (pytest-xdist
workers, DDP ranks on first use).  Numba saves an entry by reading the function's index,
adding the entry under the first unused data-file number and writing index and data
separately, so two processes saving different entries of one index at once can leave an
entry that names the other's machine code.  ``chunks.chunk_compiler`` gives every
configuration an index of its own; ``kernel_cache_race.py`` forces the worst interleaving.
And Numba checks a cached compilation against its own file only: the names the kernels are
cached under hold a digest of every kernel source.
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


_EDIT_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from kernels import chunks, lion, step_helpers
chunk = lion.chunk_function((np.float32,) * 4, "param", "nearest", False)
step_helpers.advance_counters(np.zeros(0, dtype=np.int64), np.zeros(1))
dispatcher = step_helpers.advance_counters
print(chunk.cache_hits + sum(dispatcher.stats.cache_hits.values()), chunks.KERNEL_SOURCES[:16])
"""


def test_an_edit_of_any_kernel_source_makes_the_cached_kernels_stale(tmp_path):
    """Numba checks a cached kernel against its own file only; the kernels inline helpers from
    other files (``storage.py``), so the name they are cached under holds every kernel
    source's digest: after an edit of ``storage.py`` alone a process compiles afresh."""
    import bf16opt._cpu

    package = tmp_path / "kernels"  # a copy of cpu_src with an in-tree cache of its own
    package.mkdir()
    for source in Path(bf16opt._cpu.__file__).parent.glob("*.py"):
        (package / source.name).write_bytes(source.read_bytes())
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"}

    def run():
        result = subprocess.run([sys.executable, "-c", _EDIT_SCRIPT, str(tmp_path)], env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        hits, digest = result.stdout.split()
        return int(hits), digest

    first = run()
    assert first[0] == 0  # compiled: the Lion chunk function and a step helper
    assert run() == (2, first[1])  # loaded from the cache
    with open(package / "storage.py", "a") as storage:
        storage.write("\n# an edit of a helper the kernels inline\n")
    edited = run()
    assert edited[0] == 0 and edited[1] != first[1]  # both compiled again
