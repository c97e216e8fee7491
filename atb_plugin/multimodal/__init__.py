"""Device side of the shm transport: find media blocks in prompt ids, reload the pixels, run the
encoder once per prompt and merge its features into the input embeddings (see prompt.py).

``wire.py`` (what an image is on the wire: dtypes, the pixel normalisation both sides apply) is
torch-free and imported by the input builders too, so the names below load lazily: importing
``atb_plugin.multimodal.wire`` must not pull in torch."""

__all__ = ["MediaBlock", "MediaBlockError", "MediaLayout", "MultimodalPrompt"]


def __getattr__(name):
    if name in __all__:
        from atb_plugin.multimodal import prompt

        return getattr(prompt, name)
    raise AttributeError(f"module 'atb_plugin.multimodal' has no attribute {name!r}")
