"""q8 moments of DTensor params in state dicts: one row per shard, in a "rank table".

A q8 moment of a sharded param holds the blocks of this rank's shard (docs/numerics.md,
"Distributed: q8"). It is shaped by the shard's element count, not like the param, so
``torch.distributed.checkpoint`` (DCP) cannot place it as a shard of anything: saved as a
plain tensor, DCP takes it for a replicated one, writes one rank's copy, and every rank
loads that copy. So ``state_dict()`` shows each such moment as a uint8 DTensor, the table:

* global shape ``(S_1, ..., S_k, B + 1, 260)``: ``S_i`` the size of the i-th mesh dim whose
  placement shards the param, ``B`` the blocks of the largest shard (alike on every rank);
* placements ``Shard(i - 1)`` on that i-th mesh dim, ``Replicate()`` on the other mesh dims
  (replicas hold the same state);
* each rank's row: a header (row 0), the shard's ``b`` q8 blocks (rows ``1 .. b``), then
  zero rows up to ``B``.

The header is :data:`HEADER_WORDS` little-endian int64 words (the row's first 256 bytes):
:data:`TABLE_MAGIC`, the param's ndim ``d``, ``b``, the param's shape (``d`` words), the
shard's shape (``d``) and the shard's offsets in the param (``d``), zeros after. Loading
takes this rank's row (the local tensor of a DTensor table, or its entry of a gathered one)
and checks its header against the live shard, so the same sharding gets the same codes back
(a bit-identical resume) and another one raises a ValueError, never wrong bits. A gathered
table (a full state dict) holds every shard, so it also decodes into the whole moment, which
loads into a plain param (quantized anew in the param's blocks).

A leaf module: it imports ``storage`` and ``distributed`` only.
"""

from __future__ import annotations

import math

import torch

from .distributed import dtensor_type, is_dtensor, local, local_box, shard_of
from .storage import Q8, Q8_ROW, q8_decode, q8_shape, q8_signed

__all__ = ["HEADER_WORDS", "TABLE_MAGIC", "is_local_q8", "is_rank_table", "loaded_shard", "rank_table",
           "shard_blocks", "whole_moment"]

#: first header word: b"bf16q8t1" read as a little-endian int64 (format 1 of the table)
TABLE_MAGIC = int.from_bytes(b"bf16q8t1", "little")
HEADER_WORDS = Q8_ROW // 8
_MAX_NDIM = (HEADER_WORDS - 3) // 3


def is_local_q8(value, param) -> bool:
    """Whether ``value``, a state buffer of DTensor ``param``, is a q8 moment of its shard
    (a plain uint8 tensor: every other buffer of a DTensor param is a DTensor)."""
    return isinstance(value, torch.Tensor) and not is_dtensor(value) and value.dtype == Q8 \
        and tuple(value.shape) == q8_shape(local(param).numel())


def _sharding_dims(param) -> list:
    """The mesh dims whose placement shards ``param``."""
    return [i for i, placement in enumerate(param.placements) if placement.is_shard()]


def _shard_counts(param) -> tuple:
    """The table's leading shape: the size of each mesh dim whose placement shards ``param``."""
    return tuple(param.device_mesh.size(i) for i in _sharding_dims(param))


def _largest_shard_blocks(param) -> int:
    """Blocks of the largest shard: torch.chunk's first piece is the largest, on every cut dim."""
    shape = list(param.shape)
    for i in _sharding_dims(param):
        dim = param.placements[i].dim
        shape[dim] = -(-shape[dim] // param.device_mesh.size(i))
    return q8_shape(math.prod(shape))[0]


def _header(param, blocks: int) -> torch.Tensor:
    shape, offset = local_box(param)
    words = [TABLE_MAGIC, param.ndim, blocks, *param.shape, *shape, *offset]
    row = torch.zeros(Q8_ROW, dtype=torch.uint8)
    row[:8 * len(words)] = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    return row


def rank_table(q8: torch.Tensor, param, what: str):
    """``q8``, this rank's q8 moment of DTensor ``param``, as its row of a table DTensor."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415  (a DTensor exists: imported)

    if param.ndim > _MAX_NDIM:
        raise ValueError(f"{what}: a q8 moment of a DTensor param of {param.ndim} dims cannot be saved "
                         f"(a rank table's header holds at most {_MAX_NDIM}); use a preset without q8 "
                         f"moments for this param")
    blocks, largest = q8.shape[0], _largest_shard_blocks(param)
    if blocks > largest:  # a placement whose largest shard is not torch.chunk's first piece
        raise ValueError(f"{what}: this rank's shard of a param placed {param.placements} holds "
                         f"{blocks} q8 blocks, more than the {largest} expected of its largest shard")
    row = torch.zeros((largest + 1, Q8_ROW), dtype=Q8, device=q8.device)
    row[0] = _header(param, blocks).to(q8.device)
    row[1:1 + blocks] = q8
    sharding = _sharding_dims(param)
    mesh = param.device_mesh
    placements = [Shard(sharding.index(i)) if i in sharding else Replicate() for i in range(mesh.ndim)]
    shape = _shard_counts(param) + tuple(row.shape)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return dtensor_type().from_local(row.view((1,) * len(sharding) + tuple(row.shape)), mesh, placements,
                                     run_check=False, shape=shape, stride=stride)


def is_rank_table(value) -> bool:
    """Whether a saved state buffer is a rank table (a DTensor or gathered into a plain tensor)."""
    if not isinstance(value, torch.Tensor) or value.dtype != Q8 or value.ndim < 2 \
            or value.shape[-1] != Q8_ROW or value.is_meta:
        return False
    rows = local(value)
    if rows.numel() == 0:
        return False
    first = rows.reshape(-1, rows.shape[-2], Q8_ROW)[0, 0, :8].cpu().clone()
    return int(first.view(torch.int64)) == TABLE_MAGIC


def _rows_header(rows: torch.Tensor, what: str) -> tuple:
    """(ndim, blocks, shape, shard shape, shard offset) of one row of a table, checked."""
    words = rows[0, :8 * HEADER_WORDS].cpu().clone().view(torch.int64).tolist()
    ndim, blocks = words[1], words[2]
    if words[0] != TABLE_MAGIC or not 0 <= ndim <= _MAX_NDIM or not 0 <= blocks <= rows.shape[0] - 1:
        raise ValueError(f"{what} is a q8 rank table whose row has no valid header")
    dims = words[3:3 + 3 * ndim]
    return ndim, blocks, tuple(dims[:ndim]), tuple(dims[ndim:2 * ndim]), tuple(dims[2 * ndim:])


def _own_row(table: torch.Tensor, param, what: str) -> torch.Tensor:
    """This rank's (B + 1, 260) row of ``table`` (a DTensor table, or a gathered one)."""
    sharding = _sharding_dims(param)
    if is_dtensor(table):
        rows = local(table)
        if tuple(rows.shape[:-2]) != (1,) * len(sharding):
            raise ValueError(f"{what} is a q8 rank table of local shape {tuple(rows.shape)}; this rank's "
                             f"param, placed {param.placements}, needs one row per shard")
        return rows.reshape(rows.shape[-2:])
    mesh = param.device_mesh
    if tuple(table.shape[:-2]) != _shard_counts(param):
        raise ValueError(f"{what} is a q8 rank table of {tuple(table.shape[:-2])} shards; the param is "
                         f"placed {param.placements} on a mesh of shape {tuple(mesh.shape)}")
    coordinate = mesh.get_coordinate()
    return table[tuple(coordinate[i] for i in sharding)]


def loaded_shard(table: torch.Tensor, param, role: str, what: str) -> torch.Tensor:
    """This rank's moment ``role`` of DTensor ``param`` from a rank table: its q8 blocks as
    saved where the table was saved on this sharding; from a gathered table saved on another,
    the slice of the whole moment this rank holds (float32, quantized anew by the caller)."""
    if is_dtensor(table):
        return shard_blocks(table, param, what)
    if tuple(table.shape[:-2]) == _shard_counts(param):  # gathered: its row may be this rank's shard
        rows = _own_row(table, param, what)
        header = _rows_header(rows, what)
        if _is_this_shard(header, param):
            return rows[1:1 + header[1]]
    return shard_of(whole_moment(table, role, tuple(param.shape), what), param, what)


def _is_this_shard(header: tuple, param) -> bool:
    _, blocks, shape, shard, offset = header
    box = local_box(param)
    return (shape, shard, offset) == (tuple(param.shape), *box) and blocks == q8_shape(math.prod(box[0]))[0]


def shard_blocks(table: torch.Tensor, param, what: str) -> torch.Tensor:
    """This rank's q8 moment of DTensor ``param`` from a rank table saved on the same sharding
    (its codes as saved); ValueError naming both shards when the table's row is of another."""
    rows = _own_row(table, param, what)
    header = _rows_header(rows, what)
    _, blocks, shape, shard, offset = header
    if not _is_this_shard(header, param):
        box = local_box(param)
        raise ValueError(f"{what} was saved for the shard of shape {shard} at offset {offset} of a "
                         f"param of shape {shape}; this rank holds the shard {box[0]} at {box[1]} of "
                         f"{tuple(param.shape)}. q8 state of a DTensor param loads only into the "
                         f"sharding it was saved with; to reshard, step once with a preset without q8 "
                         f"moments and checkpoint that (docs/numerics.md, 'Distributed: q8')")
    return rows[1:1 + blocks]


def whole_moment(table: torch.Tensor, role: str, shape: tuple, what: str) -> torch.Tensor:
    """The float32 moment of a param of ``shape`` that a gathered rank table (every shard's
    row, a plain tensor) holds, decoded; ValueError unless its shards tile the param."""
    if is_dtensor(table):
        raise ValueError(f"{what} is a q8 rank table sharded across ranks, which loads only into the "
                         f"sharding it was saved with; gather it (StateDictOptions(full_state_dict=True)) "
                         f"to load it into a plain param")
    moment = torch.empty(shape, dtype=torch.float32, device=table.device)
    filled = torch.zeros(shape, dtype=torch.bool)
    for rows in table.reshape(-1, *table.shape[-2:]):
        _, blocks, whole, shard, offset = _rows_header(rows, what)
        if whole != tuple(shape) or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offset, shard, shape)):
            raise ValueError(f"{what} is a q8 rank table of a param of shape {whole} (a shard {shard} at "
                             f"{offset}); the param has shape {tuple(shape)}")
        if blocks != q8_shape(math.prod(shard))[0]:
            raise ValueError(f"{what} is a q8 rank table whose shard {shard} lists {blocks} blocks")
        box = tuple(slice(o, o + n) for o, n in zip(offset, shard))
        if filled[box].any():
            raise ValueError(f"{what} is a q8 rank table whose shards overlap at {offset}")
        filled[box] = True
        moment[box] = q8_decode(rows[1:1 + blocks], shard, q8_signed(role))
    if not filled.all():
        raise ValueError(f"{what} is a q8 rank table whose shards leave {int((~filled).sum())} of the "
                         f"param's {filled.numel()} elements out: not every shard was gathered")
    return moment
