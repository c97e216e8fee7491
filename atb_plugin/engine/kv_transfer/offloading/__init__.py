"""The ``OffloadingConnector``: a host-memory LRU tier (and optionally a disk tier) under the
device prefix cache (docs/kv-transfer.md, "OffloadingConnector"). ``index``: the scheduler
side's bookkeeping of what each tier holds (one index for every rank); ``store``: the worker
side's bytes (each rank its own shard); ``connector``: the two roles."""
