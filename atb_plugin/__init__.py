"""atb-plugin device side and service: platform, ops, models, multimodal, engine, frontend, server.

``from atb_plugin import LLM, SamplingParams, PoolingParams`` is the offline API (imported lazily, so
``import atb_plugin.testing.tiny`` and friends stay light)."""

__all__ = ["LLM", "SamplingParams", "PoolingParams"]


def __getattr__(name):
    if name == "LLM":
        from atb_plugin.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from atb_plugin.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "PoolingParams":
        from atb_plugin.pooling.params import PoolingParams

        return PoolingParams
    raise AttributeError(f"module 'atb_plugin' has no attribute {name!r}")
