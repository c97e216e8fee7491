"""Prefill/decode disaggregation over the Mooncake Transfer Engine: ``transfer`` (the engine's
wrapper), ``side_channel`` (layouts and acknowledgements between ranks), ``connector`` (the
``MooncakeConnector``). docs/kv-transfer.md."""
