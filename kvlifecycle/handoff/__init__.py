"""Producer (P) and Consumer (D): a ledger tied to a transport and a side channel. The two send and serve every
side-channel message: an engine's adapter calls them and reads the ledgers' events, nothing below.

The package: :mod:`~kvlifecycle.handoff.producer` (P), :mod:`~kvlifecycle.handoff.consumer` (D),
:mod:`~kvlifecycle.handoff.options` (the options both sides take), :mod:`~kvlifecycle.handoff.links` (D's view of
one P rank), :mod:`~kvlifecycle.handoff.held_grants` (the grants of loads not started yet),
:mod:`~kvlifecycle.handoff.unclaimed_grants` (D's messages about a grant before its claim),
:mod:`~kvlifecycle.handoff.peer_calls` (D's side-channel calls off its service thread),
:mod:`~kvlifecycle.handoff.block_mapping` (which of P's blocks fill which of D's) and
:mod:`~kvlifecycle.handoff.staging_tier` (P's host staging tier in the Producer's loop: the copy to host, the claim
served from it). The control messages are in
:mod:`kvlifecycle.control`, the claim tokens in :mod:`kvlifecycle.claims`.

Flow (pull, the vLLM way): P's engine allocates and prefills (``SourceLedger.allocate`` / ``prefill_done``), then
:meth:`Producer.grant` pins the blocks under a lease and publishes a :class:`GrantReply`. D reserves target blocks
(``TargetLedger.reserve``) and calls :meth:`Consumer.pull`: D claims the lease with a heartbeat (P answers with a
per-claim token, :mod:`kvlifecycle.claims`), the load starts in D's ledger, D posts one READ for all regions, and
its completion notification (carrying the token) tells P (``consumer_done``); the last consumer releases the
lease. Renewals, failures and push requests carry the token too: only the claimant ends its claim. Push (the SGLang
way): :meth:`Consumer.request_push` asks P to WRITE into D's blocks; P's completion is P's ``consumer_done`` and a
notification to D (``part_done``), which D takes only with its claim's token. Failures travel both ways (a failed
write tells D; a failed read tells P) and every end goes through the ledgers' one release path.

Threads: the caller (an engine's scheduler) only touches ledgers and queues. Each side runs one service thread
that claims, posts, polls, drains notifications, heartbeats, sweeps expired leases and commits the log; the
transport's own thread does the NIXL calls; the side channel has its thread. D's service thread never waits on a
peer: its side-channel calls (claims, renewals, hand-backs, push requests, the renewals of announced grants) run
on a worker per P address (:mod:`kvlifecycle.handoff.peer_calls`) and their answers come back as jobs, so every
step first cancels the reads whose lease bound is reached and the loop never sleeps past the nearest bound. The
engine-facing calls that talk to P before a load (``announce``, ``load``, ``skip``, ``connect``, ``fetch_grant``,
``keep_alive``, ``hand_back``, ``fail_unstarted``) block the engine's own thread, bounded by their timeouts, and
never the service thread; ``pull`` and ``request_push`` return at once; ``invalidate_peer`` waits (bounded) for one
short job of the service thread, then tells the streams.
"""

from __future__ import annotations

from kvlifecycle.control import Claimed, GetGrant, GrantReply, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.handoff.block_mapping import BlockMappingError, map_blocks
from kvlifecycle.handoff.consumer import Consumer
from kvlifecycle.handoff.held_grants import GrantCountError
from kvlifecycle.handoff.links import REPLY_TYPES, PeerLink, compat_fields
from kvlifecycle.handoff.options import HandoffOptions
from kvlifecycle.handoff.producer import Producer
from kvlifecycle.sidechannel import Ack, SideChannelError, SideChannelRefused

__all__ = [  # the handoff's public names, wherever they are defined
    "REPLY_TYPES",
    "Ack",
    "BlockMappingError",
    "Claimed",
    "Consumer",
    "GetGrant",
    "GrantCountError",
    "GrantReply",
    "HandoffOptions",
    "Heartbeat",
    "LoadFailed",
    "PeerLink",
    "Producer",
    "PushRequest",
    "SideChannelError",  # what the Consumer's calls raise when P does not answer, or refuses (SideChannelRefused)
    "SideChannelRefused",
    "compat_fields",
    "map_blocks",
]
