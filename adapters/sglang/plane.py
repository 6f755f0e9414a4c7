"""The push data plane of the SGLang backend: one NIXL agent, KV pages and aux rows in one prepared list per side.

Why not the project's ``Transport`` protocol directly: SGLang moves two kinds of rows in one handoff, KV pages
(``num_pages`` per region) and metadata rows (``num_rows`` per aux buffer, a different count), and
:class:`kvlifecycle.transport.KVLayout` holds one block count for all regions. Until the protocol takes extra
regions, this module speaks ``nixl._api`` itself, with the machine's rules: no UCX progress thread (it spins a core;
progress is driven by polling), and ``transfer()`` — which on DRAM copies before it returns — only ever runs on the
backend's worker thread, never the scheduler's.

Descriptor lists are prepared once per peer (strided ``(addr, len, dev, stride, count)`` rows, expanded to one row
per page when the installed NIXL cannot take them), so a request's post is one ``make_prepped_xfer`` over an index
array built with numpy.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import numpy as np

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"


class PlaneError(RuntimeError):
    """A data-plane failure: the room fails, with this message as its reason."""


@dataclass(frozen=True, slots=True)
class Regions:
    """Where one side's rows live: ``ptrs[i]`` holds ``counts[i]`` rows of ``item_lens[i]`` bytes back to back."""

    ptrs: tuple[int, ...]
    item_lens: tuple[int, ...]
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.ptrs) == len(self.item_lens) == len(self.counts)):
            raise ValueError("ptrs, item_lens and counts need one entry per region")

    @property
    def offsets(self) -> np.ndarray:
        """Index of region i's first row in the prepared list."""
        return np.concatenate(([0], np.cumsum(self.counts, dtype=np.int64)[:-1])).astype(np.int64)

    def concat(self, other: Regions) -> Regions:
        return Regions(self.ptrs + other.ptrs, self.item_lens + other.item_lens, self.counts + other.counts)

    @property
    def total_rows(self) -> int:
        return int(sum(self.counts))

    def strided(self) -> np.ndarray:
        return np.array([(p, n, 0, n, c) for p, n, c in zip(self.ptrs, self.item_lens, self.counts, strict=True)],
                        dtype=np.uint64).reshape(-1, 5)

    def expanded(self) -> np.ndarray:
        rows = [np.stack([p + n * np.arange(c, dtype=np.uint64), np.full(c, n, np.uint64), np.zeros(c, np.uint64)],
                         axis=1) for p, n, c in zip(self.ptrs, self.item_lens, self.counts, strict=True)]
        return np.concatenate(rows).astype(np.uint64) if rows else np.zeros((0, 3), np.uint64)


@dataclass(slots=True)
class _Peer:
    name: str
    kv: Regions
    aux: Regions
    handle: object  # KV regions, then aux buffers: one prepared list, so a request is one NIXL post


class NixlPlane:
    """One NIXL agent for one SGLang KV manager (prefill or decode)."""

    backend_name = "nixl-ucx"

    def __init__(self, name: str, kv: Regions, aux: Regions, *, backend: str = "UCX") -> None:
        from kvlifecycle.transports.nixl_agent import make_agent

        from kvlifecycle.transport import BackendUnavailableError

        self.name = name
        self.kv = kv
        self.aux = aux
        self._lock = threading.RLock()
        try:
            self.agent = make_agent(name, [backend])
        except BackendUnavailableError as exc:  # NIXL missing, or the backend did not load
            raise PlaneError(str(exc)) from exc
        self._reg = []
        for regions in (kv, aux):
            if regions.ptrs:
                triples = [(p, n * c, 0, "") for p, n, c in zip(regions.ptrs, regions.item_lens, regions.counts,
                                                               strict=True)]
                descs = self.agent.register_memory(triples, "DRAM")
                if not descs:
                    raise PlaneError("NIXL refused to register the KV/aux memory")
                self._reg.append(descs)
        self._strided = True
        self._local = self._prep(NIXL_INIT_AGENT, kv.concat(aux)) if (kv.ptrs or aux.ptrs) else None
        self._peers: dict[str, _Peer] = {}

    # -- setup ---------------------------------------------------------------------------------------------------
    def _prep(self, agent: str, regions: Regions) -> object:
        if self._strided:
            try:
                return self.agent.prep_xfer_dlist(agent, regions.strided(), "DRAM")
            except TypeError:
                self._strided = False  # this NIXL build takes one row per descriptor only
        return self.agent.prep_xfer_dlist(agent, regions.expanded(), "DRAM")

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, kv: Regions, aux: Regions) -> str:
        """Load a peer; a peer of the same name is replaced (its prepared lists dropped first)."""
        with self._lock:
            if len(kv.ptrs) != len(self.kv.ptrs) or kv.item_lens != self.kv.item_lens:
                raise PlaneError(f"KV layout mismatch: local {len(self.kv.ptrs)} regions of {self.kv.item_lens[:1]} B,"
                                 f" peer {len(kv.ptrs)} of {kv.item_lens[:1]} B")
            try:
                name = self.agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else str(name)
                old = self._peers.pop(name, None)
                if old is not None:
                    self._release_peer(old)
                handle = self._prep(name, kv.concat(aux)) if (kv.ptrs or aux.ptrs) else None
            except PlaneError:
                raise
            except Exception as exc:  # NIXL's own error types
                raise PlaneError(f"NIXL refused the peer's metadata or memory: {exc}") from exc
            self._peers[name] = _Peer(name, kv, aux, handle)
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            if peer is not None:
                self._release_peer(peer)
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)

    def _release_peer(self, peer: _Peer) -> None:
        if peer.handle is not None:
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(peer.handle)

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    # -- transfers -----------------------------------------------------------------------------------------------
    def write(self, peer_name: str, src_pages: np.ndarray, dst_pages: np.ndarray,
              src_aux: int | None = None, dst_aux: int | None = None, *, timeout_s: float = 60.0) -> tuple[int, int,
                                                                                                          float, float]:
        """Push pages (every KV region) and optionally one aux row to the peer; returns when the bytes landed.

        Returns ``(bytes, descriptors, t_post_s, t_xfer_s)``. Raises :class:`PlaneError` on any failure; by then every
        posted request has settled (or the deadline passed), so no byte lands after the caller reports failure.
        """
        src_pages = np.asarray(src_pages, dtype=np.int64)
        dst_pages = np.asarray(dst_pages, dtype=np.int64)
        if src_pages.shape != dst_pages.shape:
            raise PlaneError(f"{src_pages.size} source pages for {dst_pages.size} destination pages")
        with self._lock:
            peer = self._peers.get(peer_name)
            if peer is None:
                raise PlaneError(f"unknown peer {peer_name!r} (restarted or never registered)")
            if src_pages.size and (src_pages.max() >= self.kv.counts[0] or dst_pages.max() >= peer.kv.counts[0]
                                   or min(src_pages.min(), dst_pages.min()) < 0):
                raise PlaneError("page id out of range")
            local_ids: list[np.ndarray] = []
            remote_ids: list[np.ndarray] = []
            nbytes = 0
            if src_pages.size and self.kv.ptrs:
                local_ids.append((self.kv.offsets[:, None] + src_pages[None, :]).ravel())
                remote_ids.append((peer.kv.offsets[:, None] + dst_pages[None, :]).ravel())
                nbytes += int(src_pages.size) * sum(self.kv.item_lens)
            if src_aux is not None and dst_aux is not None and self.aux.ptrs and peer.aux.ptrs:
                n = min(len(self.aux.ptrs), len(peer.aux.ptrs))
                if not (0 <= src_aux < self.aux.counts[0] and 0 <= dst_aux < min(peer.aux.counts[:n])):
                    raise PlaneError(f"aux row {src_aux} -> {dst_aux} out of range")
                local_ids.append(self.kv.total_rows + self.aux.offsets[:n] + src_aux)
                remote_ids.append(peer.kv.total_rows + peer.aux.offsets[:n] + dst_aux)
                nbytes += sum(self.aux.item_lens[:n])
            if not local_ids:
                return 0, 0, 0.0, 0.0
            lo = np.concatenate(local_ids).astype(np.int32)
            ro = np.concatenate(remote_ids).astype(np.int32)
            handle = None
            t0 = time.perf_counter()
            try:
                handle = self.agent.make_prepped_xfer("WRITE", self._local, lo, peer.handle, ro)
                if self.agent.transfer(handle) == "ERR":
                    raise PlaneError(f"NIXL refused to post a WRITE to {peer_name}")
                t1 = time.perf_counter()
                self._settle([handle], time.monotonic() + timeout_s)
            except PlaneError:
                self._settle_quietly([handle] if handle is not None else [], time.monotonic() + timeout_s)
                raise
            except Exception as exc:  # NIXL raises its own error types on a dead peer
                self._settle_quietly([handle] if handle is not None else [], time.monotonic() + timeout_s)
                raise PlaneError(f"NIXL WRITE to {peer_name} failed: {exc}") from exc
            finally:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        self.agent.release_xfer_handle(handle)
            t2 = time.perf_counter()
            return nbytes, int(lo.size), t1 - t0, t2 - t0

    def _settle(self, handles: list, deadline: float) -> None:
        pending = list(handles)
        spins = 0
        while pending:
            still = []
            for h in pending:
                state = self.agent.check_xfer_state(h)  # also drives UCX progress (no progress thread)
                if state == "ERR":
                    raise PlaneError("NIXL reported ERR for a WRITE")
                if state != "DONE":
                    still.append(h)
            pending = still
            if not pending:
                return
            if time.monotonic() > deadline:
                raise PlaneError("NIXL WRITE did not settle before its deadline")
            spins += 1
            time.sleep(0 if spins < 64 else 0.0005)

    def _settle_quietly(self, handles: list, deadline: float) -> None:
        with contextlib.suppress(PlaneError):
            self._settle(handles, deadline)

    def close(self) -> None:
        with self._lock:
            for name in list(self._peers):
                self.remove_peer(name)
            if self._local is not None:
                with contextlib.suppress(Exception):
                    self.agent.release_dlist_handle(self._local)
            for descs in self._reg:
                with contextlib.suppress(Exception):
                    self.agent.deregister_memory(descs)
            self._reg = []
