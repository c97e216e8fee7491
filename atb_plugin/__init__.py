"""atb-plugin device side and service: platform, ops, models, multimodal, engine, frontend, server.

``from atb_plugin import LLM, SamplingParams, PoolingParams, LoRARequest`` is the offline API (imported lazily, so
``import atb_plugin.testing.tiny`` and friends stay light)."""

__all__ = ["LLM", "SamplingParams", "PoolingParams", "LoRARequest"]


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
    if name == "LoRARequest":
        from atb_plugin.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'atb_plugin' has no attribute {name!r}")
