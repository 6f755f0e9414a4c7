"""The proxy's one error: an upstream failure as the client should see it. A leaf, so both request paths (the
proxy's own, :mod:`kvlifecycle.tools.proxy`, and the layer-wise one, :mod:`kvlifecycle.tools.proxy_layerwise`)
raise and catch it without importing each other."""

from __future__ import annotations


class ProxyError(Exception):
    """An upstream failure with the HTTP status and message the client should see."""

    def __init__(self, status: int, message: str, kind: str = "upstream_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
