"""The ids of D's loads as the event logs write them (docs/wire.md records them); built and read only here.

- A load of one P transfer is named after it: D's and P's logs share the id.
- A load read from several prefill ranks (P TP > D TP) is ``<request><-<t1>+<t2>...``: D's request, then each
  rank's P transfer in part order. A P transfer id inside it holds neither ``<-`` nor ``+``, so the id reads back
  exactly whatever the request holds (:func:`source_transfers` splits at the last ``<-``).
- A load D refused before asking for any byte (:meth:`~kvlifecycle.handoff.Consumer.fail_unstarted`) is
  ``<P transfer>/refused-by-d``, or ``<request>/refused-by-d`` with no grant: never P's own id, so D's log never
  shows a read of P's transfer that did not happen.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PART_SEPARATOR", "RANKS_SEPARATOR", "REFUSED_SUFFIX", "load_id", "refused_load_id", "source_transfers"]

RANKS_SEPARATOR = "<-"  # between D's request and the P transfers of a multi-rank load
PART_SEPARATOR = "+"  # between the P transfers, in part order
REFUSED_SUFFIX = "/refused-by-d"


def load_id(request: str, transfers: Sequence[str]) -> str:
    """The id of D's load of ``request`` reading ``transfers`` (one per P rank, in part order). Raises ValueError
    for no transfer, or a transfer id that would not read back (it holds ``<-``, or ``+`` among several)."""
    if not transfers:
        raise ValueError(f"a load of {request!r} reads no P transfer")
    for transfer in transfers:
        if RANKS_SEPARATOR in transfer or (len(transfers) > 1 and PART_SEPARATOR in transfer) or not transfer:
            raise ValueError(f"P transfer id {transfer!r} cannot be part of a load id (it must be non-empty and "
                             f"hold neither {RANKS_SEPARATOR!r} nor, read from several ranks, {PART_SEPARATOR!r})")
    if len(transfers) == 1:
        return transfers[0]
    return f"{request}{RANKS_SEPARATOR}{PART_SEPARATOR.join(transfers)}"


def source_transfers(load: str) -> list[str]:
    """The P transfer ids the load ``load`` reads: each rank's of a multi-rank load, else the id itself. Total:
    any string reads as one of the two, never raises."""
    _, separator, tail = load.rpartition(RANKS_SEPARATOR)
    if separator:
        parts = tail.split(PART_SEPARATOR)
        if all(parts):
            return parts
    return [load]


def refused_load_id(base: str) -> str:
    """The id of a load D refused before it started: ``base`` is the first grant's P transfer, or D's request."""
    return f"{base}{REFUSED_SUFFIX}"
