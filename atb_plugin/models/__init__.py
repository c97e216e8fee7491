"""Device-side models. Every model follows the contract in ``decoder.DecoderForCausalLM``; the
multimodal ones add ``get_multimodal_embeddings`` (see ``atb_plugin.multimodal``)."""
