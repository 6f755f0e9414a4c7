"""The handoff's protocol decisions as a deterministic core: state + message + now in, a decision out. No threads,
sockets or wall clock live here, so that the threaded runtime (:mod:`kvlifecycle.handoff.producer`,
:mod:`kvlifecycle.handoff.consumer`) and the simulator (:mod:`kvlifecycle.sim`) drive the same rules.

- :mod:`.writes`: P's book of the WRITEs it accepted for pushes (one per part; none outlives its lease; a lease
  with a write in flight is released only once the write settled).
- :mod:`.bounds`: how long D may trust a read under a lease it renewed (a read never outlives its lease), and until
  when a push of a P declared lost may still land (a write never outlives its lease).
- :mod:`.producer`: P's decisions over its ledger (renewals, hand-backs, pushes, writes, notifications, the sweep).
- :mod:`.load`: one load's progress at D (each part counted once, the last settles it; a failure waits for the
  sibling reads still in flight), the class the Consumer's and the simulator's loads both are.
- :mod:`.launch`: D's launch of a load (every lease claimed in part order, then ``start_load``) and what each
  service step owes it (a read past its lease's bound cancelled, a failure settled, the timeout, the heartbeat).
- :mod:`.consumer`: D's decisions on a refused renewal, an unanswered push, a load timeout, a hand-back's answer.
"""

from kvlifecycle.protocol.bounds import (
    READ_DEADLINE_FRACTION,
    RENEWAL_TOO_LATE,
    RenewalClock,
    WriteBound,
    renewal_too_late,
)
from kvlifecycle.protocol.load import LoadProgress
from kvlifecycle.protocol.writes import WRITE_IN_FLIGHT, PushWrites, is_write_in_flight

__all__ = ["READ_DEADLINE_FRACTION", "RENEWAL_TOO_LATE", "WRITE_IN_FLIGHT", "LoadProgress", "PushWrites",
           "RenewalClock", "WriteBound", "is_write_in_flight", "renewal_too_late"]
