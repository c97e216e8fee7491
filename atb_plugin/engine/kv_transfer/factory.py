"""The registry of KV connectors: ``kv_transfer_config.kv_connector`` names one. A connector
registers itself by module path (imported only when asked for, so an optional transport's
package is needed only by the engines that use it)."""

from __future__ import annotations

import importlib

from atb_plugin.engine.kv_transfer.base import ConnectorContext, KVConnectorBase, KVConnectorRole
from atb_plugin.engine.kv_transfer.config import OFFLOADING_CONNECTOR, KVTransferConfig

# name -> (module, class name)
_REGISTRY: dict[str, tuple[str, str]] = {}


def register_connector(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY and _REGISTRY[name] != (module, class_name):
        raise ValueError(f"KV connector {name!r} is registered already (by {_REGISTRY[name][0]})")
    _REGISTRY[name] = (module, class_name)


def registered_connectors() -> list[str]:
    return sorted(_REGISTRY)


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    if config.kv_connector_module_path is not None:
        importlib.import_module(config.kv_connector_module_path)
    if config.kv_connector not in _REGISTRY:
        raise ValueError(f"kv_transfer_config.kv_connector = {config.kv_connector!r}: unknown; registered: "
                         f"{', '.join(registered_connectors()) or 'none'}")
    module, class_name = _REGISTRY[config.kv_connector]
    cls = getattr(importlib.import_module(module), class_name)
    if not issubclass(cls, KVConnectorBase):
        raise TypeError(f"KV connector {config.kv_connector!r}: {module}.{class_name} is not a KVConnectorBase")
    return cls


def create_connector(config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> KVConnectorBase:
    return connector_class(config)(config, role, context)


# The connectors this package ships (each one file, or one folder for a transport's several).
register_connector(OFFLOADING_CONNECTOR, "atb_plugin.engine.kv_transfer.offloading.connector", "OffloadingConnector")
register_connector("MooncakeConnector", "atb_plugin.engine.kv_transfer.mooncake.connector", "MooncakeConnector")
register_connector("MultiConnector", "atb_plugin.engine.kv_transfer.multi", "MultiConnector")
