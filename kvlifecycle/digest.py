"""Per-block KV digests: what lands is what was sent.

P digests each granted block as each D consumer will read it and sends the digests with the grant; D digests what
landed in its own blocks and refuses the load on any mismatch *before* ``part_done`` lets attention read a byte
(:meth:`kvlifecycle.ledger.TargetLedger.digest_mismatch`).

**The digest of a block** is a two-level hash. Each region of the block's region group gives a *leaf*: XXH3-64
over the block's slice in that region (``offset``/``length`` in the first group, as a
:class:`~kvlifecycle.transport.BlockView` cuts a rank's heads; the other groups whole). The block's digest is
XXH64 over its leaves, region after region, as little-endian u64. No address, slot index or block id enters it, so
it is the same wherever the block sits in either pool: a block written into the wrong slot arrives under the wrong
digest, and a region's slice landed in another region changes the order of the leaves. A unit may be made of
several pieces (D's sub-blocks of one P block under a block size split): a leaf hashes the pieces' slices of its
region concatenated, which is the byte order of the one P block.

**Why XXH3-64, and why two levels.** A 64-bit non-cryptographic hash runs at memory speed (XXH3 hashes >20 GB/s on
one x86 core from cache, so a pass over host DRAM is bound by the memory, not the hash), has full avalanche (every
flipped bit changes half the output bits), and misses a random corruption with probability 2^-64 per block (2^-63
here: a corruption must collide in a leaf or in the root). Adler-32 (SGLang's P/D checksum) is 32 bits with weak
mixing on short inputs and blind to some reorderings; CRC32C is fast in hardware but 32 bits, and detects reordered
equal-sized pieces poorly. XXH3 is a chain of one dependent step per KiB: over a whole block across every region
(2 MiB in 64 regions of 32 KiB) that is 2,048 steps in a row, 42 µs on a GPU whatever its bandwidth, longer than the
copy of a small request. Per region, the chain is the slice's KiB (32 steps) and every leaf runs at once; the root,
XXH64 over one word per region, is a short loop a GPU thread runs for any count of regions (XXH3 would need its
short-input paths below 241 bytes, i.e. 30 regions). The host pays nothing for the split: it hashed a block region
by region already. The digest is not a MAC: it catches faults, not an adversary (the side channel's HMAC covers the
digests in transit). The binding is ``xxhash`` (the reference C library's Python wrapper, maintained upstream,
wheels for every platform): a core dependency, with no torch.

**Head slices.** A lease read by ``consumers`` D ranks (D TP > P TP) is read in ``consumers`` equal slices of the
first region group's blocks; P sends a digest per (slice, block), so each D rank checks exactly the heads it read,
and a rank whose slice landed in the wrong heads fails. Under P TP > D TP each P rank sends whole-block digests and
D checks each P rank's slice of its own blocks (the TP plan's local view).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec
import numpy as np
import xxhash

from kvlifecycle.choices import Choice

DIGEST_ALGO = "xxh3-64/xxh64"  # leaves per region / the root over them: a peer of the flat XXH3 digest is refused
DIGEST_DTYPE = np.dtype("<u8")
# one transfer in this many is checked under ``verify: sample``; the choice is a function of the transfer id, so
# P (which computes) and D (which checks) agree without a word
SAMPLE_EVERY = 16
MAX_DIGEST_BYTES = 8 << 20  # 1 Mi digests (a grant of 1 Mi blocks × slices): past it a peer's field is refused
MAX_SLICES = 1 << 10


class VerifyMode(Choice):
    """Which transfers carry and check per-block digests."""

    NONE = "none"  # no digest is computed, sent or checked
    SAMPLE = "sample"  # one transfer in SAMPLE_EVERY, chosen by its id: catches a systematic fault at 1/16 the cost
    ALL = "all"  # every transfer


VerifyModeName = Literal["none", "sample", "all"]


def should_digest(mode: VerifyMode | VerifyModeName, transfer: str) -> bool:
    """Whether P digests ``transfer`` under ``mode`` (D checks whatever digests a grant carries)."""
    mode = VerifyMode.parse(mode, "verify")
    if mode is VerifyMode.NONE:
        return False
    return mode is VerifyMode.ALL or xxhash.xxh3_64_intdigest(transfer.encode()) % SAMPLE_EVERY == 0


class BlockDigests(msgspec.Struct, frozen=True, array_like=True):
    """The wire form of P's digests for one grant: ``values`` holds ``slices`` × blocks little-endian u64
    digests, slice-major, in the grant's block order. Bounded at decode; its fit to a grant is checked where it is
    used (:func:`expected_digests`), so a malformed field refuses the load, never the service loop."""

    algo: str
    slices: Annotated[int, msgspec.Meta(ge=1, le=MAX_SLICES)]
    values: Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)]

    @staticmethod
    def of(digests: np.ndarray) -> BlockDigests:
        """From a ``(slices, blocks)`` (or ``(blocks,)``) array of digests."""
        arr = np.asarray(digests, dtype=DIGEST_DTYPE)
        arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
        return BlockDigests(DIGEST_ALGO, int(arr.shape[0]), arr.tobytes())


class DigestError(ValueError):
    """A grant's digest field does not fit the grant (algorithm, size or slice): the load is refused."""


def expected_digests(digests: BlockDigests, blocks: int, slice_index: int) -> np.ndarray:
    """The digests of slice ``slice_index`` for a grant of ``blocks`` blocks; :class:`DigestError` if the field
    cannot hold them (a peer's bytes: never trusted to fit)."""
    if digests.algo != DIGEST_ALGO:
        raise DigestError(f"digest algorithm {digests.algo!r}, this side computes {DIGEST_ALGO!r}")
    if len(digests.values) != digests.slices * blocks * DIGEST_DTYPE.itemsize:
        raise DigestError(f"{len(digests.values)} digest bytes for {digests.slices} slice(s) of {blocks} blocks")
    if not 0 <= slice_index < digests.slices:
        raise DigestError(f"slice {slice_index} of {digests.slices}")
    values: np.ndarray = np.frombuffer(digests.values, dtype=DIGEST_DTYPE).reshape(digests.slices, blocks)
    row: np.ndarray = values[slice_index]
    return row


def slice_view(block_bytes: int, slices: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of head slice ``index`` of ``slices`` in a block of ``block_bytes`` (what consumer
    ``index`` of a lease read by ``slices`` D ranks reads: :func:`kvlifecycle.layout.tp_plan`)."""
    if slices < 1 or block_bytes % slices or not 0 <= index < slices:
        raise DigestError(f"{block_bytes}-byte blocks do not split into slice {index} of {slices}")
    length = block_bytes // slices
    return index * length, length


def digest_units(regions: Sequence[Sequence[np.ndarray]], units: np.ndarray, *, offset: int = 0,
                 length: int = 0, only: Sequence[int] | None = None) -> np.ndarray:
    """The digest of each unit of blocks (one row of ``units``: one block, or the pieces of one), position
    independent.

    ``regions[g]`` holds group ``g``'s regions, each a ``(blocks of the group, block bytes)`` uint8 array; block
    ids run over the groups in order (group ``g`` starts after the blocks of the groups before it). ``offset`` and
    ``length`` (0: to the block's end) slice each block of the first group; other groups are digested whole. Every
    piece of a unit must be in the same group. ``units``: int array, ``(n,)`` or ``(n, pieces)``. ``only``: the
    regions to digest (indices over every group's regions in registration order: a layer's, for a stream's layer
    batch); a unit reads those of its own group, in that order."""
    ids = np.asarray(units, dtype=np.int64)
    ids = ids.reshape(-1, 1) if ids.ndim == 1 else ids
    starts = np.cumsum([0] + [int(g[0].shape[0]) if len(g) else 0 for g in regions])
    out = np.empty(ids.shape[0], dtype=DIGEST_DTYPE)
    for row, pieces in enumerate(ids):
        group = int(np.searchsorted(starts, pieces[0], side="right")) - 1
        if group < 0 or group >= len(regions) or not (starts[group] <= pieces).all() or \
                not (pieces < starts[group + 1]).all():
            raise DigestError(f"unit {pieces.tolist()} is not within one region group of {int(starts[-1])} blocks")
        local = pieces - starts[group]
        first = sum(len(g) for g in regions[:group])  # the group's first region, over every group's regions
        chosen = regions[group] if only is None else \
            [regions[group][r - first] for r in only if first <= r < first + len(regions[group])]
        leaves = np.empty(len(chosen), dtype=DIGEST_DTYPE)
        for i, region in enumerate(chosen):
            lo, hi = (offset, offset + length if length else region.shape[1]) if group == 0 else (0, region.shape[1])
            if local.size == 1:
                leaves[i] = xxhash.xxh3_64_intdigest(region[local[0], lo:hi].data)  # a view: no copy of the bytes
            else:
                h = xxhash.xxh3_64()
                for block in local:
                    h.update(region[block, lo:hi].data)
                leaves[i] = h.intdigest()
        out[row] = root_digest(leaves)
    return out


def root_digest(leaves: np.ndarray) -> int:
    """A unit's digest from its leaves (one XXH3-64 per region, in order): XXH64 over them as little-endian u64."""
    return xxhash.xxh64_intdigest(np.ascontiguousarray(leaves, dtype=DIGEST_DTYPE).data)


def batch_digest(digests: np.ndarray) -> int:
    """One digest of a batch of blocks (a stream's layer batch): XXH3-64 over their digests in order, so one u64
    rides in the batch's notification however many blocks it names (a list would outgrow the note's cap)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(digests, dtype=DIGEST_DTYPE).tobytes())


def mismatched(expected: np.ndarray, found: np.ndarray) -> np.ndarray:
    """Positions where ``found`` differs from ``expected`` (equal lengths)."""
    return np.flatnonzero(np.asarray(expected, dtype=DIGEST_DTYPE) != np.asarray(found, dtype=DIGEST_DTYPE))


class BlockDigester(Protocol):
    """Digests blocks where they live (host DRAM, a GPU): a transport implements it over its registered regions.
    The core never reads KV memory itself."""

    def digests(self, units: np.ndarray, *, offset: int = 0, length: int = 0,
                only: Sequence[int] | None = None) -> np.ndarray:
        """:func:`digest_units` over this worker's KV regions: one u64 per unit (row of ``units``); ``only``: the
        regions to read (a layer's), in order, indexed over every group's regions."""
        ...
