"""Layer-wise KV streaming: P writes each layer of a request into D's reserved blocks as soon as that layer is
computed, so D's blocks are READY_FOR_ATTENTION moments after P's last layer instead of one whole transfer later.

Reading order: :mod:`~kvlifecycle.streaming.wire` (options and the per-layer note), :mod:`~kvlifecycle.streaming.
producer` (P: reservations, per-layer posts, settling), :mod:`~kvlifecycle.streaming.consumer` (D: the stream's
ledger load, its notes, cancel and timeouts). The flow, the fallback and the cancel rules: ``docs/streaming.md``.
"""

from kvlifecycle.streaming.consumer import StreamConsumer
from kvlifecycle.streaming.producer import StreamProducer, StreamStatus
from kvlifecycle.streaming.wire import StreamOptions

__all__ = ["StreamConsumer", "StreamOptions", "StreamProducer", "StreamStatus"]
