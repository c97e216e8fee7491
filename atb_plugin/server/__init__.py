"""The OpenAI-compatible HTTP service: protocol models, metrics, MindIE config mapping, API server."""
