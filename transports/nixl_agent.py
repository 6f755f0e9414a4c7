"""The one place that builds NIXL agents (nixl 1.5.1, ``nixl._api``): the transport (SGLang's backend's too), the
doctor and the transport benchmark all ask :func:`make_agent`.

The project's rules for an agent live here once: no UCX progress thread unless asked (it spins a core; callers
drive progress by polling), NIXL's start-up chatter kept below WARNING unless ``NIXL_LOG_LEVEL`` asks for it, a
backend's parameters given over the plugin's own defaults, and a backend that did not load named with the plugins
that exist, instead of a later opaque failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from kvlifecycle.transport import BackendUnavailableError

INSTALL_HINT = "pip install 'kvlifecycle[transports]' (nixl==1.5.1)"


def nixl_api() -> Any:
    """The ``nixl._api`` module; :class:`BackendUnavailableError` with the install line when NIXL is missing."""
    try:
        import nixl._api as api
    except ImportError as exc:
        raise BackendUnavailableError(f"NIXL is not installed: {INSTALL_HINT}") from exc
    return api


def quiet_nixl_logs() -> None:
    """NIXL logs every agent start at INFO: its loggers at WARNING at least, unless ``NIXL_LOG_LEVEL`` is set."""
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    for name in ["nixl", *(n for n in list(logging.root.manager.loggerDict) if n.startswith("nixl."))]:
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.level, logging.WARNING))  # never lowers a caller's stricter level


def make_agent(
    name: str,
    backends: Sequence[str] = ("UCX",),
    *,
    progress_thread: bool = False,
    capture_telemetry: bool = False,
    num_threads: int = 0,
    backend_params: Mapping[str, Mapping[str, str]] | None = None,
    require_backends: bool = True,
) -> Any:
    """A ``nixl_agent`` named ``name`` with ``backends`` (none: ``backends=()``, e.g. to list the plugins).

    ``backend_params``: per backend, parameters laid over the plugin's defaults (that backend is then created with
    them after the agent). ``require_backends``: raise :class:`BackendUnavailableError` naming the plugins when a
    backend did not load (else the caller checks ``agent.backends`` itself). NIXL's own exceptions propagate."""
    api = nixl_api()
    quiet_nixl_logs()
    params = dict(backend_params or {})
    plain = [b for b in backends if b not in params]
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=plain,
                                   capture_telemetry=capture_telemetry, num_threads=num_threads)
    agent = api.nixl_agent(name, config)
    for backend, given in params.items():
        merged = {k: str(v) for k, v in agent.get_plugin_params(backend).items()}
        merged.update({k: str(v) for k, v in given.items()})
        agent.create_backend(backend, merged)
    quiet_nixl_logs()  # loggers the agent's start created
    if require_backends:
        missing = [b for b in backends if b not in agent.backends]
        if missing:
            raise BackendUnavailableError(
                f"NIXL backend(s) {missing} did not load for agent {name!r}; plugins available: "
                f"{agent.get_plugin_list()}")
    return agent
