"""Low-precision linear layers (docs/quantization.md): msModelSlim checkpoints (W8A16,
W8A8_DYNAMIC, static W8A8) and on-the-fly int8 quantization of float checkpoints
(``--quantization w8a16|w8a8``).

- ``config``: the checkpoint's ``quant_model_description*.json`` (``QuantConfig``) and the flag;
- ``layers``: the quantized linear modules' base (msModelSlim's tensor names as parameters), their
  methods' base (``models/linear.py``) and the weight quantization;
- ``w8a16``, ``w8a8_dynamic``, ``w8a8_static``: one scheme each, its layer and its method;
- ``quantize``: the quantization configs, which hand each linear layer its method as the model
  is built (on the fly for a float checkpoint, msModelSlim's description for a quantized one);
- ``export``: writing a float checkpoint out in msModelSlim's layout.
"""

from atb_plugin.models.quantization.config import (METHODS, QuantConfig, QuantizationError, read_quant_config,
                                            resolve_quantization)

__all__ = ["METHODS", "QuantConfig", "QuantizationError", "read_quant_config", "resolve_quantization"]
