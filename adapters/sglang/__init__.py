"""kvlifecycle as an SGLang P/D transfer backend: ``--disaggregation-transfer-backend kvlifecycle``.

Importing this package imports no SGLang (the plugin entry point loads :mod:`.plugin`, which defers SGLang imports
to call time); the classes SGLang instantiates are gathered in :mod:`.conn` and exported lazily here, the manager
both roles share in :mod:`.manager`, its prefill and decode halves in :mod:`.prefill` and :mod:`.decode` (the
core's handoff and streams), the transport over SGLang's pages and aux rows in :mod:`.transfer`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BACKEND_NAME",
    "KVLifecycleKVBootstrapServer",
    "KVLifecycleKVManager",
    "KVLifecycleKVReceiver",
    "KVLifecycleKVSender",
]

BACKEND_NAME = "kvlifecycle"  # the --disaggregation-transfer-backend value; defined here alone


def __getattr__(name: str) -> Any:
    if name in __all__[1:]:
        from kvlifecycle.adapters.sglang import conn

        return getattr(conn, name)
    raise AttributeError(name)
