"""What each of vLLM NixlConnector's settings becomes under KVLifecycleConnector: honoured (same name, same meaning),
mapped (to an option of ours with that meaning) or refused at start-up in words. None is ignored: a NixlConnector
setting copied into ``kv_connector_extra_config`` either works as its user meant or stops the server naming why.

The lists are checked against the real NixlConnector's source in the vLLM environment
(``tests/vllm/test_vllm_migration.py``), so a setting a new vLLM adds shows up as a test failure, not as silence.
docs/migrating-from-nixl.md is the page for people.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

Fate = Literal["honoured", "mapped", "refused"]


@attrs.frozen
class Migration:
    """One NixlConnector setting: its fate, our option that carries it (mapped, honoured), and why (refused)."""

    fate: Fate
    option: str = ""
    why: str = ""


# kv_connector_extra_config keys NixlConnector reads (vLLM 0.32: base_scheduler.py, base_worker.py, push_scheduler.py)
EXTRA_CONFIG: dict[str, Migration] = {
    "backends": Migration("honoured", "backends", "the NIXL backends to load, in order of preference"),
    "kv_lease_duration": Migration("mapped", "lease_ttl_s", "seconds P holds a request's blocks for D (a lease "
                                   "D renews while it reads)"),
    "enforce_handshake_compat": Migration("refused", why="kvlifecycle always checks P and D agree (model, dtype, "
                                          "layout, block size, TP) at the handshake and refuses naming the field; "
                                          "the check cannot be turned off"),
    "engine_ttl": Migration("refused", why="a remote engine's state is dropped when its epoch changes or etcd "
                            "says it left, not after a TTL; remove the key"),
    "decoder_kv_blocks_ttl": Migration("refused", why="D's reserved blocks are bounded by the lease "
                                       "(lease_ttl_s) and load_timeout_s, not by a separate TTL; remove the key"),
    "kv_recompute_threshold": Migration("refused", why="every prompt's KV is handed off (short prompts are not "
                                        "recomputed on D); remove the key"),
    "bidirectional_kv_xfer": Migration("refused", why="KV moves from P to D only; remove the key"),
    "num_threads": Migration("refused", why="the NIXL agent runs one progress thread of its own; remove the key"),
    "push_registration_timeout": Migration("mapped", "load_timeout_s", "seconds D waits for a load (in push "
                                           "mode: for P's writes) before it fails it"),
}

# --kv-transfer-config fields (vLLM's KVTransferConfig), as NixlConnector users set them
TRANSFER_CONFIG: dict[str, Migration] = {
    "kv_connector": Migration("mapped", "kv_connector", '"KVLifecycleConnector", with kv_connector_module_path '
                              '"kvlifecycle.adapters.vllm"'),
    "kv_connector_module_path": Migration("honoured", "kv_connector_module_path", "where vLLM imports the "
                                          "connector from"),
    "kv_role": Migration("honoured", "kv_role", "kv_producer (P), kv_consumer (D) or kv_both (one instance "
                         "that is P and D, a source and a target ledger, etcd membership as each)"),
    "engine_id": Migration("honoured", "engine_id", "names the instance in its workers' names and logs"),
    "kv_load_failure_policy": Migration("honoured", "kv_load_failure_policy", "fail: the request fails with the "
                                        "load's reason; recompute: D prefills it itself"),
    "kv_connector_extra_config": Migration("honoured", "kv_connector_extra_config", "the options; NixlConnector's "
                                           "keys in it as EXTRA_CONFIG says"),
    "kv_buffer_device": Migration("refused", why="KV moves from the device it lives on: a host staging buffer "
                                  "(kv_buffer_device=cpu with the KV cache on a GPU) is refused at start-up"),
    "enable_permute_local_kv": Migration("refused", why="P and D must agree on the KV layout (the handshake "
                                         "refuses a mismatch); true is refused at start-up"),
    "kv_port": Migration("honoured", "kv_port", "read by neither connector (the side channel has its own port)"),
}


def check_transfer_config(kv_config: Any) -> None:
    """Refuse, at start-up, the ``--kv-transfer-config`` fields NixlConnector honours and this connector cannot."""
    if bool(getattr(kv_config, "enable_permute_local_kv", False)):
        raise ValueError(f"--kv-transfer-config enable_permute_local_kv=true: "
                         f"{TRANSFER_CONFIG['enable_permute_local_kv'].why}")


def check_buffer_device(kv_config: Any, kv_cache_device_type: str) -> None:
    """Refuse a host staging buffer for a KV cache on a GPU (NixlConnector's ``kv_buffer_device: cpu``)."""
    wanted = getattr(kv_config, "kv_buffer_device", None)
    if wanted == "cpu" and kv_cache_device_type == "cuda":
        raise ValueError(f"--kv-transfer-config kv_buffer_device='cpu' with the KV cache on cuda: "
                         f"{TRANSFER_CONFIG['kv_buffer_device'].why}")


# environment variables NixlConnector reads
ENV: dict[str, Migration] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": Migration("honoured", "side_channel_host", "the host P's side channel binds "
                                             "(KVL_SIDE_CHANNEL_HOST refines it)"),
    "VLLM_NIXL_SIDE_CHANNEL_PORT": Migration("honoured", "side_channel_port", "P's side-channel base port "
                                             "(KVL_SIDE_CHANNEL_PORT refines it)"),
}


def migrate_extra_config(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with NixlConnector's keys carried over to ours; a key with no meaning here, or a mapped key given
    together with the option it maps to, is a ``ValueError`` naming both."""
    out = dict(extra)
    for key, migration in EXTRA_CONFIG.items():
        if key not in out or migration.fate == "honoured":
            continue
        if migration.fate == "refused":
            if key == "enforce_handshake_compat" and out[key] is True:
                del out[key]  # what kvlifecycle does anyway
                continue
            raise ValueError(f"kv_connector_extra_config key {key!r} is NixlConnector's and has no meaning for "
                             f"KVLifecycleConnector: {migration.why}")
        if migration.option in out:
            raise ValueError(f"kv_connector_extra_config gives both {key!r} (NixlConnector's) and "
                             f"{migration.option!r}, which it maps to: keep {migration.option!r}")
        out[migration.option] = out.pop(key)
    return out
