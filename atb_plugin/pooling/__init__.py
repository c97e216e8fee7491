"""Pooling models: runner / convert / task resolution (``config``), request parameters
(``params``), poolers (``poolers``), adapters from generative classes (``adapters``), frontend
input helpers (``inputs``) and output types (``outputs``). ``config``, ``params`` and ``inputs``
import no torch (the server's API process uses them)."""
