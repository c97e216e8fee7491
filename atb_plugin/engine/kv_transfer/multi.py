"""``MultiConnector`` (vLLM's): several connectors stacked, e.g. a PD transport over a host tier.

``kv_connector_extra_config = {"connectors": [<kv_transfer_config dicts>, ...]}``. A waiting
request is asked of each in order and takes its external tokens from the first that has any
(vLLM's rule); every connector is told of the allocation (the others with 0 external tokens, so
they still save), sees every step and every finish. A finished request's blocks stay while any
of them delays the free, until each of those reports it sent. Each sub-config inherits the
outer ``kv_role``, ``engine_id`` and ``kv_load_failure_policy`` unless it names its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from atb_plugin.engine.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput
from atb_plugin.engine.kv_transfer.config import KVTransferConfig
from atb_plugin.engine.kv_transfer.factory import connector_class
from atb_plugin.engine.messages import KVTransferStats


@dataclass
class MultiMetadata(KVConnectorMetadata):
    metadata: list[KVConnectorMetadata | None] = field(default_factory=list)  # one per connector, in order
    # Finished requests whose free more than one connector delays: how many must report them sent.
    expected_sends: dict[str, int] = field(default_factory=dict)


def sub_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    connectors = config.kv_connector_extra_config.get("connectors")
    if not isinstance(connectors, list) or not connectors:
        raise ValueError("MultiConnector: kv_connector_extra_config.connectors must be a non-empty list of "
                         "kv_transfer_config objects")
    unknown = sorted(set(config.kv_connector_extra_config) - {"connectors"})
    if unknown:
        raise ValueError(f"MultiConnector: unknown kv_connector_extra_config keys {unknown}; known: connectors")
    inherited = {"kv_role": config.kv_role, "engine_id": config.engine_id,
                 "kv_load_failure_policy": config.kv_load_failure_policy}
    subs = []
    for index, value in enumerate(connectors):
        if not isinstance(value, dict):
            raise ValueError(f"MultiConnector: connectors[{index}] must be a kv_transfer_config object")
        try:
            sub = KVTransferConfig.from_value({**inherited, **value})
        except ValueError as error:
            raise ValueError(f"MultiConnector: connectors[{index}]: {error}") from None
        if sub.kv_connector == "MultiConnector":
            raise ValueError(f"MultiConnector: connectors[{index}] is a MultiConnector itself")
        subs.append(sub)
    return subs


class MultiConnector(KVConnectorBase):
    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        for index, sub in enumerate(sub_configs(config)):
            try:
                connector_class(sub).check_config(sub)
            except ValueError as error:
                raise ValueError(f"MultiConnector: connectors[{index}]: {error}") from None

    @classmethod
    def needs_prefix_caching(cls, config: KVTransferConfig) -> bool:
        return any(connector_class(sub).needs_prefix_caching(sub) for sub in sub_configs(config))

    def __init__(self, config, role, context):
        super().__init__(config, role, context)
        self.connectors = [connector_class(sub)(sub, role, context) for sub in sub_configs(config)]
        self._chosen: dict[str, int] = {}  # request id -> the connector its external tokens come from
        self._expected_sends: dict[str, int] = {}
        self._sent: Counter[str] = Counter()  # worker side: connectors that reported a request sent

    # -- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._chosen.pop(request.request_id, None)
        for index, connector in enumerate(self.connectors):
            tokens, load_async = connector.get_num_new_matched_tokens(request, num_computed_tokens)
            if tokens is None:
                return None, False  # ask every connector again next step
            if tokens:
                self._chosen[request.request_id] = index
                return tokens, load_async
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        chosen = self._chosen.pop(request.request_id, None)
        for index, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(request, block_ids, num_external_tokens if index == chosen else 0)

    def build_connector_meta(self, scheduler_output) -> MultiMetadata:
        meta = MultiMetadata([c.build_connector_meta(scheduler_output) for c in self.connectors],
                             self._expected_sends)
        self._expected_sends = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for connector in self.connectors:
            connector.update_connector_output(output)

    def request_finished(self, request, block_ids):
        delays, params = 0, None
        for connector in self.connectors:
            delay, returned = connector.request_finished(request, block_ids)
            delays += bool(delay)
            if returned is not None:
                params = {**(params or {}), **returned}
        if delays > 1:
            self._expected_sends[request.request_id] = delays
        return delays > 0, params

    def get_stats(self):
        merged = None
        for connector in self.connectors:
            stats = KVTransferStats.from_value(connector.get_stats())
            if stats is not None:
                merged = stats if merged is None else merged.merged(stats, sum_gauges=True)
        return merged

    # -- worker side

    def register_kv_caches(self, kv_caches: list) -> None:
        for connector in self.connectors:
            connector.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata) -> None:
        super().bind_connector_metadata(metadata)
        for connector, meta in zip(self.connectors, metadata.metadata):
            connector.bind_connector_metadata(meta)
        for request_id, count in metadata.expected_sends.items():
            self._expected_sends[request_id] = count

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for connector in self.connectors:
            connector.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for connector in self.connectors:
            connector.start_load_kv()

    def wait_for_layer_load(self, layer_index: int) -> None:
        for connector in self.connectors:
            connector.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int) -> None:
        for connector in self.connectors:
            connector.save_kv_layer(layer_index)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def get_finished(self, finished_request_ids):
        sending, recving = set(), set()
        for connector in self.connectors:
            sent, received = connector.get_finished(finished_request_ids)
            self._sent.update(sent)
            recving |= received
        for request_id, count in list(self._sent.items()):
            # One connector's report suffices unless the scheduler said several delayed it.
            if count >= self._expected_sends.get(request_id, 1):
                sending.add(request_id)
                del self._sent[request_id]
                self._expected_sends.pop(request_id, None)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(connector.get_block_ids_with_load_errors() for connector in self.connectors))

    def get_stored_block_hashes(self) -> set[bytes]:
        return set().union(*(connector.get_stored_block_hashes() for connector in self.connectors))

    def shutdown(self) -> None:
        for connector in self.connectors:
            connector.shutdown()
