"""``KVTransferConfig``: the validated ``kv_transfer_config`` (vLLM's keys), torch-free.

``LLM(..., kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"cpu_bytes_to_use": 2**30}})`` or
``--kv-transfer-config '<the same JSON>'``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields

from atb_plugin.utils import json_object

# vLLM's roles: a producer saves / sends KV (a prefill instance), a consumer loads / receives it
# (a decode instance), "kv_both" does both (an offloading tier is written and read by one engine).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# What a consumer does with a request whose KV failed to load (vLLM's kv_load_failure_policy):
# compute the missing tokens itself, or end the request with an error.
LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """``kv_connector``: a registered connector's name (``factory.registered_connectors()``);
    ``kv_role``: one of ``KV_ROLES``; ``kv_connector_extra_config``: the connector's own keys
    (each connector validates them when it is built); ``kv_load_failure_policy``: one of
    ``LOAD_FAILURE_POLICIES``; ``engine_id``: this instance's name among its peers (a fresh
    uuid when not given); ``kv_connector_module_path``: a module to import that registers
    ``kv_connector`` (a connector that lives outside this package)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_connector_module_path: str | None = None

    def __post_init__(self):
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_transfer_config.kv_connector must name a connector, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role = {self.kv_role!r}: expected one of {', '.join(KV_ROLES)}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object, got "
                             f"{type(self.kv_connector_extra_config).__name__}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy = {self.kv_load_failure_policy!r}: "
                             f"expected one of {', '.join(LOAD_FAILURE_POLICIES)}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {self.engine_id!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value) -> KVTransferConfig | None:
        """None, a ``KVTransferConfig``, a dict of its keys or a JSON string of one (the CLI's)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json_object(value)
            except ValueError as error:
                raise ValueError(f"kv_transfer_config (--kv-transfer-config) {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config.kv_connector is required (the connector's name)")
        return cls(**value)


# vLLM's --kv-offloading-size: the host tier's size in GiB, a shortcut for this connector.
OFFLOADING_CONNECTOR = "OffloadingConnector"


def resolve_kv_transfer_config(value, kv_offloading_size: float | None) -> KVTransferConfig | None:
    """``kv_transfer_config`` (``from_value``'s forms) or the ``kv_offloading_size`` shortcut
    (GiB: the OffloadingConnector, kv_both, ``cpu_bytes_to_use`` = GiB * 2**30); not both."""
    config = KVTransferConfig.from_value(value)
    if kv_offloading_size is None:
        return config
    if config is not None:
        raise ValueError("kv_offloading_size (--kv-offloading-size) and kv_transfer_config (--kv-transfer-config) "
                         "both given: the size is a shortcut for an OffloadingConnector config; give one of them "
                         "(the host tier's size in kv_connector_extra_config.cpu_bytes_to_use)")
    size = kv_offloading_size
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"kv_offloading_size (--kv-offloading-size) = {size!r}: must be a positive number of GiB")
    return KVTransferConfig(OFFLOADING_CONNECTOR, "kv_both", {"cpu_bytes_to_use": int(size * 2**30)})
