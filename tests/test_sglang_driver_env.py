"""The SGLang driver changes the environment in ``main()``, before SGLang is imported, and never on import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER_DIR = str(Path(__file__).resolve().parent / "sglang")  # the driver is a test module
SCRIPT = """
import json, os
import sys
sys.path.insert(0, DRIVER_DIR)
import sglang_driver as driver
after_import = {k: os.environ.get(k) for k, _ in driver.LOOPBACK_DEFAULTS}
try:
    driver.main(["--role", "decode", "--port", "1", "--out", os.devnull])
except ImportError:  # no SGLang here: main() got as far as importing it
    pass
print(json.dumps({"after_import": after_import,
                  "after_main": {k: os.environ.get(k) for k, _ in driver.LOOPBACK_DEFAULTS}}))
"""


def test_importing_the_driver_sets_nothing_and_main_sets_the_loopback_defaults_it_does_not_override() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES", "SGLANG_HOST_IP", "HOST_IP")}
    env["UCX_TLS"] = "tcp"  # the caller's choice stays
    script = SCRIPT.replace("DRIVER_DIR", repr(DRIVER_DIR))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": None, "SGLANG_HOST_IP": None, "HOST_IP": None}
    assert seen["after_main"] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "SGLANG_HOST_IP": "127.0.0.1",
                                  "HOST_IP": "127.0.0.1"}
