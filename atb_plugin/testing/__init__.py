"""Test support that ships with the package, importable by tests and benchmarks alike.

`tiny` builds small, seeded, structurally real Hugging Face checkpoints for every model family
(no downloads); see docs/architecture.md (layout).
"""
