"""Pooling types, torch-free (the server's API process uses them): runner / convert / task
resolution (``config``), request parameters (``params``), frontend input helpers (``inputs``) and
output types (``outputs``). The torch side lives with the models: the poolers in
``atb_plugin.models.poolers``, the adapters from generative classes in
``atb_plugin.models.pooling_adapters``."""
