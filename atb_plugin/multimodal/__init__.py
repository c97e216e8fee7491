"""Device side of the shm transport: find media blocks in prompt ids, reload the pixels, run the
encoder once per prompt and merge its features into the input embeddings (see prompt.py)."""

from atb_plugin.multimodal.prompt import MediaBlock, MediaBlockError, MediaLayout, MultimodalPrompt

__all__ = ["MediaBlock", "MediaBlockError", "MediaLayout", "MultimodalPrompt"]
