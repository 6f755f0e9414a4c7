"""The faults the simulation injects or provokes, by name. A run counts each one it exercised; a fault listed
here that no seed of a CI run exercised is reported as unexercised (and fails that run)."""

from __future__ import annotations

# late_redelivery: a push request or a transport notification delivered once arrives again later (a retransmit
# whose first copy got through); late_push_after_settle: such a push request reaches P after its write settled, its
# lease still live (P must not write it a second time)
# late_renewal: a lease renewal, delivered once, arrives at P again while its D waits out the write bound of that P
# it declared lost (P must refuse it: held back past its transit bound)
NETWORK = ("drop", "duplicate", "reorder", "slow_link", "partition", "heal", "late_redelivery",
           "late_push_after_settle", "late_renewal")
# uncancellable_copy_waited: a copy its transport cannot cancel (CUDA IPC's rule: a released or orphaned copy runs
# on) ended after the runtime stopped wanting it or its peer was removed, the runtime still holding its blocks;
# peer_invalidated: D's control plane declared a P lost while a read from it ran (seeds that cannot cancel);
# peer_invalidated_writing: ... while P, alive and cut off from the control plane only, wrote into D (a push's or a
# stream's write in flight): D's blocks stay LOADING until P's lease, or its stream's peer timeout, ends the write
TRANSPORT = ("post_fail", "handle_fail", "sibling_fail_in_flight", "duplicate_completion", "late_completion",
             "uncancellable_copy_waited", "peer_invalidated", "peer_invalidated_writing")
CANCEL = (
    "cancel_p:before_grant",
    "cancel_p:granted",
    "cancel_p:claimed",
    "cancel_p:in_flight",
    "cancel_p:racing_completion",
    "cancel_p:after",
    "cancel_d:reserved",
    "cancel_d:loading",
    "cancel_d:ready",
)
LEASES = ("lease_expired", "heartbeat_after_expiry", "fail_after_release")
RESTARTS = ("p_restart", "torn_tail", "d_crash", "stale_epoch_refused")
# tp_handles: a D rank reads two P ranks (P TP > D TP); two_consumer_lease: two D ranks read one P rank's lease
# clock_jump_*: NTP stepped a node's wall clock (its HLC's source) by seconds; its monotonic clock did not move
ENGINE = ("allocator_reuse", "clock_drift", "clock_jump_forward", "clock_jump_back", "push", "pull", "tp_handles",
          "two_consumer_lease", "prefix_share")
# layer-wise streaming: a stream began; D's reservation came after P's prefill began (declined); a layer's write
# failed; D, or P, cancelled mid-stream; P died mid-stream; D timed a stream out (P lost, or its last note lost),
# one P still held (its write window bounds P's writes); P's window closed with a write in flight (cancelled); P
# stopped the streams of a D silent (crashed, cut off) for the peer timeout
# stream_stall: everything paused past D's stream timeout with a layer write in flight
STREAMS = ("stream", "stream_declined", "stream_write_fail", "stream_cancel_d", "stream_cancel_p", "stream_p_crash",
           "stream_timeout", "stream_timeout_held", "stream_window_closed", "stream_d_silent", "stream_stall")

# a worker's disk while it runs (sim/storage.py): ENOSPC, EIO (each sometimes after a short write), short writes,
# failed fsyncs, and the disk coming back
STORAGE = ("enospc", "eio", "short_write", "fsync_fail", "disk_back")

# P's host staging tier (sim/staging.py): a copy posted; D's claim raced a copy in flight; P crashed mid-copy; a due
# lease found the pool full; a staged copy's lease expired; D read a staged copy from the pool; P wrote one from the
# pool into a D that pushes
STAGING = ("staging", "staging_copy_races_claim", "staging_crash_mid_copy", "staging_pool_full",
           "staging_lease_expired", "staging_read_host", "staging_push_host")

# wrong bytes landing (sim/corruption.py): a flipped byte, a block in the wrong slot, a head slice in the wrong
# heads; corruption_refused: D's digest check recorded a mismatch and failed the load (corruption_refused_stream: a
# layer batch of a stream's)
CORRUPTION = ("corrupt_flip", "corrupt_slot", "corrupt_slice", "corruption_refused", "corruption_refused_stream")

ALL: tuple[str, ...] = (NETWORK + TRANSPORT + CANCEL + LEASES + RESTARTS + ENGINE + STREAMS + STORAGE + STAGING
                        + CORRUPTION)

# What --faults may switch off (the rest are observations of the run, not injections).
INJECTABLE = {
    "drop": ("drop",),
    "duplicate": ("duplicate",),
    "reorder": ("reorder",),
    "slow": ("slow_link", "stream_stall"),
    "partition": ("partition",),
    "post_fail": ("post_fail",),
    "handle_fail": ("handle_fail",),
    "duplicate_completion": ("duplicate_completion",),
    "cancel": ("cancel",),
    "expiry": ("expiry",),
    "p_restart": ("p_restart",),
    "d_crash": ("d_crash",),
    "drift": ("drift",),
    "jump": ("clock_jump_forward", "clock_jump_back"),
    "redeliver": ("late_redelivery", "late_push_after_settle", "late_renewal"),
    "disk": STORAGE,
    "corrupt": CORRUPTION,
    "uncancellable": ("uncancellable_copy_waited", "peer_invalidated"),
    "invalidate_writer": ("peer_invalidated_writing",),
}


def parse_faults(text: str | None) -> frozenset[str]:
    """``--faults``: a comma-separated subset of :data:`INJECTABLE` (``all`` or None: every one)."""
    if text is None or text.strip() in ("", "all"):
        return frozenset(INJECTABLE)
    names = {t.strip() for t in text.split(",") if t.strip()}
    unknown = names - set(INJECTABLE)
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(sorted(INJECTABLE))}")
    return frozenset(names)
