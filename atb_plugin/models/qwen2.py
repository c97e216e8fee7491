"""Qwen2 (the decoder is shared: see decoder.py), and its native reward model."""

from torch import nn

from atb_plugin.models.decoder import Qwen2ForCausalLM
from atb_plugin.models.poolers import DispatchPooler
from atb_plugin.models.pooling_adapters import PoolingModelMixin, classification_poolers
from atb_plugin.pooling.config import CONVERT_TASKS, PoolerConfig

__all__ = ["Qwen2ForCausalLM", "Qwen2ForRewardModel"]


class Qwen2ForRewardModel(PoolingModelMixin, Qwen2ForCausalLM):
    """Qwen2.5-Math-RM style: the decoder, then ``score = Linear(H, H) -> ReLU -> Linear(H, 1)``
    on every token (``score.0.*``, ``score.2.*`` in the checkpoint); the reward of a response is
    the value at its last token. One label, as vLLM fixes it for this architecture."""

    default_pooling_type = "ALL"

    def __init__(self, config):
        super().__init__(config)
        self._drop_lm_head()
        self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(),
                                   nn.Linear(config.hidden_size, 1))

    def build_pooler(self, pooler_config: PoolerConfig) -> DispatchPooler:
        return classification_poolers(pooler_config, self.score, CONVERT_TASKS["reward"])
