"""KV connectors: KV cache that comes from, or goes to, somewhere other than this engine's own
device blocks (a host-memory / disk tier, another instance). docs/kv-transfer.md."""
