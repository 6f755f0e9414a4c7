"""Run in the SGLang venv: load SGLang's plugins the way its processes do and report what the backend lookup
returns (printed as one JSON line)."""

import json
import os

from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES  # noqa: E402
from sglang.srt.disaggregation import utils  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend  # noqa: E402

out = {"plugins_env": os.environ.get("SGLANG_PLUGINS", ""), "choices": list(DISAGG_TRANSFER_BACKEND_CHOICES)}
try:
    backend = TransferBackend("kvlifecycle")
    out["member"] = backend.name
    out["classes"] = {
        kind: f"{cls.__module__}.{cls.__qualname__}"
        for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
        if (cls := utils.get_kv_class(backend, getattr(KVClassType, kind))) is not None
    }
    # the one manager class SGLang gets for both roles makes the half of the role it is given (nothing initialised)
    from sglang.srt.disaggregation.utils import DisaggregationMode

    manager = utils.get_kv_class(backend, KVClassType.MANAGER)
    out["halves"] = {
        mode.name: f"{type(half).__module__}.{type(half).__qualname__}" if isinstance(half, manager) else None
        for mode in (DisaggregationMode.PREFILL, DisaggregationMode.DECODE)
        if (half := manager.__new__(manager, None, mode, None)) is not None
    }
except ValueError as exc:
    out["member"] = None
    out["error"] = str(exc)
out["nixl"] = {
    kind: f"{cls.__module__}.{cls.__qualname__}"
    for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER")
    if (cls := utils.get_kv_class(TransferBackend.NIXL, getattr(KVClassType, kind))) is not None
}
out["kvargs_shared"] = utils.get_kv_class(TransferBackend.NIXL, KVClassType.KVARGS).__name__
out["nixl_members_intact"] = [m.value for m in TransferBackend][:5]
if out.get("member"):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "unused", "--disaggregation-mode", "prefill",
                                "--disaggregation-transfer-backend", "kvlifecycle"])
    out["parsed_backend"] = args.disaggregation_transfer_backend
print(json.dumps(out))
