"""Low-precision linear layers (docs/quantization.md): msModelSlim checkpoints (W8A16,
W8A8_DYNAMIC, static W8A8) and on-the-fly int8 quantization of float checkpoints
(``--quantization w8a16|w8a8``).

- ``config``: the checkpoint's ``quant_model_description*.json`` (``QuantConfig``) and the flag;
- ``layers``: the quantized linear modules, msModelSlim's tensor names as parameters;
- ``quantize``: swapping them into a model (before an msModelSlim checkpoint loads, or after a
  float one did);
- ``export``: writing a float checkpoint out in msModelSlim's layout.
"""

from atb_plugin.models.quantization.config import (METHODS, QuantConfig, QuantizationError, read_quant_config,
                                            resolve_quantization)

__all__ = ["METHODS", "QuantConfig", "QuantizationError", "read_quant_config", "resolve_quantization"]
