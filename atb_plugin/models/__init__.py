"""Device-side models. Every model follows the contract in ``decoder.DecoderForCausalLM``; the
multimodal ones (``base.MultimodalModel``) add the capabilities declared in ``interfaces``
(``SupportsMedia``, ``SupportsMRoPE``; see also ``atb_plugin.multimodal``)."""
