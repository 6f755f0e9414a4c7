"""Wrong bytes landing: the simulated transport may corrupt a transfer as it completes, and the real digest path
(:mod:`kvlifecycle.digest`: P's per-block digests with the grant, or a stream's per-batch digest; D's check before
``part_done`` or ``layers_landed``) must refuse the load before attention may read a block.

The kinds, each a transfer's fault (a ``complete`` step's last field):

- ``flip``: one byte of what landed is flipped (a bad NIC or NVLink lane);
- ``slot``: a block written into the wrong slot: two blocks of the transfer land in each other's slots; a transfer
  of one block reads its source's neighbouring slot instead (a block id mapped to the wrong slot);
- ``slice``: a head slice read from, or written into, the other heads of its block (a wrong TP mapping: a D rank of
  a lease read by two consumers reading its sibling's slice, or a P rank's heads written over its sibling's); only
  where a side of the transfer reads or writes a slice of its blocks.

Only transfers that reach a D are corrupted (not P's copies into its host staging pool). Whether a seed verifies is
drawn from the seed alone (:func:`verify_mode`): most seeds verify ``all`` and only those are corrupted, so a CI run
is clean exactly when every corruption was refused; a config that sets ``verify`` itself is corrupted whatever it
says, so with ``verify=none`` the READY tag check sees the corruption (``corrupted_reads``) that the digests refuse.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Literal

import numpy as np

from kvlifecycle.digest import VerifyMode, digest_units

Corruption = Literal["", "flip", "slot", "slice"]
# a seed that draws its mode verifies unless this one in VERIFY_OFF_EVERY (kept: the unverified path runs too)
VERIFY_OFF_EVERY = 8


def verify_mode(configured: VerifyMode | None, seed: int) -> VerifyMode:
    """The seed's ``verify``: the config's, else drawn from the seed alone (not the scheduler's RNG: a replayed step
    list runs with the same mode)."""
    if configured is not None:
        return configured
    off = zlib.crc32(f"{seed}/verify".encode()) % VERIFY_OFF_EVERY == 0
    return VerifyMode.NONE if off else VerifyMode.ALL


class SimDigester:
    """:class:`~kvlifecycle.digest.BlockDigester` over a worker's simulated KV regions (one region group), read in
    place, as ``transports.digest_host.HostDigester`` reads registered host memory."""

    def __init__(self, regions: Sequence[np.ndarray]) -> None:
        self._groups = [list(regions)]

    def digests(self, units: np.ndarray, *, offset: int = 0, length: int = 0,
                only: Sequence[int] | None = None) -> np.ndarray:
        return digest_units(self._groups, units, offset=offset, length=length, only=only)


def other_slice(offset: int, length: int, block_bytes: int) -> int:
    """The offset of the next head slice of a block (wrapping): where a wrong TP mapping puts a slice."""
    return (offset + length) % block_bytes


__all__ = ["VERIFY_OFF_EVERY", "Corruption", "SimDigester", "other_slice", "verify_mode"]
