"""The ``sglang.srt.plugins`` entry point: makes ``kvlifecycle`` a transfer backend without patching SGLang's files.

SGLang's ``TransferBackend`` enum and ``get_kv_class`` are closed; its plugin loader runs ``register()`` in every
process (launcher, scheduler, detokenizer) before the server arguments are parsed, so here we

1. add ``"kvlifecycle"`` to the ``--disaggregation-transfer-backend`` choices (``add_disagg_transfer_backend_choices``);
2. add a ``KVLIFECYCLE`` member to ``TransferBackend`` in place, so ``TransferBackend("kvlifecycle")`` works and every
   existing member keeps its identity;
3. wrap ``get_kv_class`` through SGLang's ``HookRegistry`` (an AROUND hook): ``kvlifecycle`` gets our classes, every
   other backend goes to SGLang's own function unchanged.

``SGLANG_PLUGINS`` (comma-separated entry-point names) filters which plugins load; ours is named ``kvlifecycle``.
"""

from __future__ import annotations

from typing import Any

from kvlifecycle.adapters.sglang import BACKEND_NAME

MEMBER_NAME = "KVLIFECYCLE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"

_registered = False


def extend_transfer_backend() -> Any:
    """Add ``TransferBackend.KVLIFECYCLE`` (value ``"kvlifecycle"``) to SGLang's enum, once; returns the member."""
    from sglang.srt.disaggregation.utils import TransferBackend

    existing = TransferBackend._value2member_map_.get(BACKEND_NAME)
    if existing is not None:
        return existing
    member = object.__new__(TransferBackend)
    member._name_ = MEMBER_NAME
    member._value_ = BACKEND_NAME
    member.__objclass__ = TransferBackend
    member.__init__(BACKEND_NAME)
    # Enum keeps its members in these three tables; an attribute makes TransferBackend.KVLIFECYCLE work too
    TransferBackend._member_map_[MEMBER_NAME] = member
    TransferBackend._value2member_map_[BACKEND_NAME] = member
    TransferBackend._member_names_.append(MEMBER_NAME)
    type.__setattr__(TransferBackend, MEMBER_NAME, member)
    return member


def kvlifecycle_classes() -> dict[Any, type]:
    from kvlifecycle.adapters.sglang.conn import (
        KVLifecycleKVBootstrapServer,
        KVLifecycleKVManager,
        KVLifecycleKVReceiver,
        KVLifecycleKVSender,
    )
    from sglang.srt.disaggregation.utils import KVClassType

    return {
        KVClassType.MANAGER: KVLifecycleKVManager,
        KVClassType.SENDER: KVLifecycleKVSender,
        KVClassType.RECEIVER: KVLifecycleKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVLifecycleKVBootstrapServer,
    }


def get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook on ``get_kv_class``: ours for ``kvlifecycle``, SGLang's for everything else."""
    from sglang.srt.disaggregation.utils import KVClassType

    value = getattr(transfer_backend, "value", transfer_backend)
    if value == BACKEND_NAME and class_type != KVClassType.KVARGS:
        return kvlifecycle_classes().get(class_type)
    return original(transfer_backend, class_type)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (see pyproject.toml). Idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    extend_transfer_backend()
    HookRegistry.register(GET_KV_CLASS, get_kv_class_hook, HookType.AROUND)
    _registered = True


def install() -> None:
    """``register()`` plus applying the hooks now: for processes that never run SGLang's ``load_plugins()``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()
