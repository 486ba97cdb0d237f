"""The launch plan shared by the kernels: a chunk table over many tensors.

One kernel call updates every tensor of a bucket.  The tensors are cut into chunks of at
most ``CHUNK`` elements; row ``c`` of the table holds, for each buffer of the update
(param, grad, master, moments...), the byte address of the chunk's first element, and
in its last column the chunk's length.  The kernels run ``prange`` over rows, so a
model with hundreds of small tensors costs one call, and a large tensor is spread over
all threads.  Buffers a configuration does not have get address 0 and are never read.

Every element is computed independently of the others, so results do not depend on
the chunk size or the number of threads.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CHUNK", "build_chunk_table"]

#: elements per chunk: large enough for long vector loops, small enough to balance threads
CHUNK = 1 << 15


def build_chunk_table(addresses: np.ndarray, itemsizes: np.ndarray, numels: np.ndarray,
                      chunk: int = CHUNK) -> np.ndarray:
    """int64 table (n_chunks, n_buffers + 1) for tensors described by their addresses.

    ``addresses[t, b]`` is the byte address of buffer ``b`` of tensor ``t`` (contiguous
    memory), ``itemsizes[b]`` its element size in bytes (0 for an absent buffer),
    ``numels[t]`` the tensor's element count.  Empty tensors get no rows.
    """
    addresses = np.asarray(addresses, dtype=np.int64)
    itemsizes = np.asarray(itemsizes, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    n_tensors, n_buffers = addresses.shape
    counts = (numels + (chunk - 1)) // chunk
    tensor_of_row = np.repeat(np.arange(n_tensors), counts)
    first_row = np.cumsum(counts) - counts
    start = (np.arange(tensor_of_row.size, dtype=np.int64) - first_row[tensor_of_row]) * chunk
    table = np.empty((tensor_of_row.size, n_buffers + 1), dtype=np.int64)
    table[:, :n_buffers] = addresses[tensor_of_row] + start[:, None] * itemsizes[None, :]
    table[:, n_buffers] = np.minimum(numels[tensor_of_row] - start, chunk)
    return table
