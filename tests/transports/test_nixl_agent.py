"""The one NIXL agent builder (real NIXL, UCX on this machine): backends loaded or named as missing, parameters
laid over the plugin's defaults, a one-line install hint without NIXL."""

from __future__ import annotations

import sys
import time

import pytest

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports import nixl_agent

from kvlifecycle.transport import BackendUnavailableError

pytestmark = pytest.mark.nixl


def test_an_agent_has_the_backends_it_was_asked_for() -> None:
    agent = nixl_agent.make_agent(f"agent-{time.monotonic_ns()}", ["UCX"])
    assert list(agent.backends) == ["UCX"]
    bare = nixl_agent.make_agent(f"bare-{time.monotonic_ns()}", backends=())
    assert not bare.backends and "UCX" in bare.get_plugin_list()


def test_backend_parameters_are_laid_over_the_plugins_defaults() -> None:
    agent = nixl_agent.make_agent(f"params-{time.monotonic_ns()}", ["UCX"], backend_params={"UCX": {"num_workers": 2}})
    params = agent.get_backend_params("UCX")
    defaults = agent.get_plugin_params("UCX")
    assert params["num_workers"] == "2"
    assert {k: v for k, v in params.items() if k != "num_workers"} == {
        k: v for k, v in defaults.items() if k != "num_workers"}


def test_a_backend_that_does_not_load_is_named_with_the_plugins_that_exist() -> None:
    with pytest.raises(BackendUnavailableError, match=r"NOT_A_BACKEND.*plugins available.*UCX"):
        nixl_agent.make_agent(f"missing-{time.monotonic_ns()}", ["UCX", "NOT_A_BACKEND"])


def test_without_nixl_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import nixl._api now raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"kvlifecycle\[transports\]"):
        nixl_agent.make_agent("never-built")
