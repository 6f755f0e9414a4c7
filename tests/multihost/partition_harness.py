"""Network faults between namespace hosts, made with iptables: packets dropped where they arrive (the receiver's
INPUT chain), so a sender sees what a cut cable shows it (silence, retransmits), never a local error.

A :class:`Faults` records every rule it adds and :meth:`Faults.clear` removes them (the tests call it in a
finalizer; deleting the namespaces removes them too). Every command is bounded.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from dataclasses import dataclass, field

from netns_harness import COMMAND_TIMEOUT_S, Host


def iptables_missing() -> str | None:
    return None if shutil.which("iptables") else "iptables is missing: run scripts/setup-etcd.sh"


@dataclass
class Faults:
    rules: list[tuple[Host, list[str]]] = field(default_factory=list)

    def _add(self, host: Host, rule: list[str]) -> None:
        out = host.run(["iptables", "-I", "INPUT", *rule], timeout_s=COMMAND_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"iptables in {host.netns} refused {rule}: {out.stderr.strip()}")
        self.rules.append((host, rule))

    def drop(self, sender: Host, receiver: Host) -> None:
        """One way: nothing ``sender`` sends reaches ``receiver``."""
        self._add(receiver, ["-s", sender.address, "-j", "DROP"])

    def cut(self, a: Host, b: Host) -> None:
        """Both ways between ``a`` and ``b``."""
        self.drop(a, b)
        self.drop(b, a)

    def isolate(self, host: Host, others: list[Host]) -> None:
        """``host``'s cable pulled: nothing it sends arrives anywhere, nothing reaches it."""
        self._add(host, ["-i", host.device, "-j", "DROP"])
        for other in others:
            self.drop(host, other)

    def clear(self) -> None:
        """Remove every rule added (each once); a namespace already gone is skipped."""
        while self.rules:
            host, rule = self.rules.pop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.run(["iptables", "-D", "INPUT", *rule], timeout_s=COMMAND_TIMEOUT_S)
