"""``TargetHiddenStates``: the target model's hidden states that a head proposer (EAGLE, EAGLE-3,
MTP) drafts from, kept by the model runner from the step that computed them until the proposer
takes them.

After each step the runner records, per request, the rows of the positions the step kept (a
prefill chunk's, a plain decode's, a verify step's last token and accepted drafts: never a
rejected draft's): the last layer's output (EAGLE, MTP), or the residual stream entering the
EAGLE-3 head's auxiliary layers, concatenated (vLLM's ``eagle_aux_hidden_state_layer_ids``: id
``j`` is the output of layer ``j - 1``, 0 the embeddings), caught by forward hooks on those
layers. A request that finishes or is preempted drops its rows; the proposer takes the rest
when it drafts for the request (docs/speculative.md, "Head proposers").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TargetHiddenStates:
    def __init__(self, layers: Sequence[torch.nn.Module] | None = None, aux_layer_ids: Sequence[int] = ()):
        """``layers``: the target's decoder layers, where ``aux_layer_ids`` (EAGLE-3) are read;
        none: the last layer's output (the model's hidden states) is what is kept."""
        self.aux_layer_ids = tuple(aux_layer_ids)
        self._aux: dict[int, torch.Tensor] = {}
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for j in sorted(set(self.aux_layer_ids)):
            if not 0 <= j <= len(layers):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids: {j} is not in [0, {len(layers)}] (the target "
                                 f"has {len(layers)} layers; id j is the output of layer j - 1)")
            if j == 0:
                layers[0].register_forward_pre_hook(self._keep_input)
            else:
                layers[j - 1].register_forward_hook(self._hook_output(j))

    @property
    def reads_layers(self) -> bool:
        """Intermediate layers are read: the forward must run them one by one (no captured step)."""
        return bool(self.aux_layer_ids)

    def _keep_input(self, module, args):
        self._aux[0] = args[0]

    def _hook_output(self, j: int):
        def hook(module, args, output):
            self._aux[j] = output
        return hook

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The step's rows the proposer needs: ``hidden`` (the model's output), or the auxiliary
        layers' states side by side (``(T, len(aux) * hidden_size)``)."""
        if not self.aux_layer_ids:
            return hidden
        try:
            return torch.cat([self._aux[j] for j in self.aux_layer_ids], dim=-1)
        finally:
            self._aux.clear()

    def record(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """Rows of positions ``start ..`` of ``request_id`` (a copy: the step's tensor is not kept)."""
        self._pending.setdefault(request_id, []).append((start, rows.clone()))

    def take(self, request_id: str) -> list[tuple[int, torch.Tensor]]:
        """The recorded ``(first position, rows)`` of ``request_id`` since the last call, in order."""
        return self._pending.pop(request_id, [])

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
