"""The captured decode step on the CPU: a decoder's whole decode forward replayed by one native call.

Why: at one request a decode step is ~300 native kernel calls and ~650 torch ops, each with
Python, dispatch and output allocation around far less work for the small ones: a sizeable share
of the step (benchmarks/RESULTS.md, bench_engine.py, "Fifth round"). A GPU removes that host cost by
capturing the step once as a CUDA graph (an NPU, as an ACL graph) and replaying it; here the
same idea is a plan: ``capture`` records, once per engine, the address of every layer's weights
(the native linear kernel's column panels, the norms) and KV cache, the sizes, and a scratch
area for the activations; each decode step then hands this step's inputs (embeddings, rotary
tables, slots, block tables, lengths) to ``decode_step_f32`` (csrc/cpu_kernels.c), which runs
every layer and the final norm in C with the same kernels as the eager path, in the same order.

Each linear layer enters the plan in its own format, which its method names
(``LinearMethodBase.native_operands``, models/linear.py): float32 or bfloat16 panels (the float
method's ``PanelLinear``), int8 rows with their scales (W8A16 and dynamic W8A8 layers, whose
eager forward calls the same native int8 kernels). The activations are float32 in every case. So a
float32 model's step, quantized or not, is bit-identical to its eager path
(tests/test_native_decode.py); a bfloat16 model's is not: it keeps its weights and KV cache in
bfloat16 but no longer rounds every activation to bfloat16 as its eager ops do, so it sits closer
to float32 (docs/quantization.md, "Quality"). Without it a bfloat16 or int8 model ran eager, and
its per-op host time cancelled most of what the smaller weights saved (benchmarks/RESULTS.md,
"Low precision").

LoRA (docs/lora.md): where the linear layers are LoRA-wrapped, the plan also holds their adapter
slots (read in place) and the step's rows (``LoRAStep``); a step with adapted rows sets
``decode_model.lora`` and the native LoRA kernel adds each row's adapter after each linear layer.
Without adapted rows ``lora`` stays NULL and the step is the base step.

Qwen3's per-head q / k norms run in the plan with the eager kernel (a dense Qwen3 step stays
bit-identical); a sparse MoE layer (Qwen3-MoE, Qwen2-MoE's shared expert) runs its router and the
native grouped experts (csrc/moe_kernels.c) over the model's own stacked float32 experts, equal to
the eager ``ops.fused_moe`` within float32 rounding (docs/moe-decode.md). bfloat16 experts and a
rank holding only some experts stay eager, and say why.

Tensor parallelism (docs/architecture.md, "Tensor-parallel ranks"): a rank's plan holds its shard
(its heads, KV heads and intermediate features, as its eager layers hold them) and sums each
row-parallel output over the ranks inside the native call, through the group's shared-memory
exchange (csrc/tp_allreduce.c, the same rounds as ``distributed.all_reduce``, the same sum in the
same order): a rank's decode step is one native call, with the embedding's all-reduce before it
and the logits' all-gather after it in Python, and bit-identical to its eager TP step. Every rank
captures or none does (``_agree``): a rank must never wait in an all-reduce the others do not enter.

Unlike a CUDA graph, the batch size is an argument, not part of the capture: no buckets, no
padded rows. What is captured are pointers, so the weights and caches must not move after
``capture``: they are made once per engine and never reallocated. Only decode-only steps run
captured; prefill and mixed steps take the eager forward. ``EngineConfig.enforce_eager``
(``--enforce-eager``, as in vLLM) turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from atb_plugin.distributed import all_gather_object, native_exchange, tp_rank, tp_size
from atb_plugin.models.moe import SparseMoeBlock
from atb_plugin.ops import AttentionMetadata, cpu_native

# The KV cache dtypes the plan reads and writes (csrc/cpu_kernels.h, decode_model.kv_bf16).
CACHE_DTYPES = (torch.float32, torch.bfloat16)


class NativeDecodeStep:
    """A captured decode step over one ``DecoderModel`` and its KV caches, for up to ``max_rows``
    requests. ``applies(kv_caches, metadata)`` says whether a step can run captured;
    ``__call__(embeds, cos, sin, metadata)`` runs it and returns the final hidden states."""

    def __init__(self, library, model, kv_caches, max_rows: int, linears: list[list[cpu_native.LinearOperands]],
                 lora=None, tp: cpu_native.DecodeTP | None = None):
        config = model.config
        self.library, self.kv_caches, self.max_rows = library, kv_caches, max_rows
        self.hidden, self.head_dim = config.hidden_size, config.head_dim
        self.num_blocks, self.block_size = kv_caches[0][0].shape[:2]
        self._layers = (cpu_native.DecodeLayer * len(model.layers))()
        # Every tensor whose address the plan holds, kept alive (and unmoved) with it.
        self._keep: list[torch.Tensor] = []
        self._sparse: list[cpu_native.DecodeMoe] = []  # the sparse layers' structs, kept alive with the plan
        for entry, layer, operands, (key_cache, value_cache) in zip(self._layers, model.layers, linears, kv_caches):
            entry.input_norm = self._address(layer.input_layernorm.weight.to(torch.float32).contiguous())
            entry.post_norm = self._address(layer.post_attention_layernorm.weight.to(torch.float32).contiguous())
            entry.qkv, entry.o, entry.gate_up, entry.down = (self._linear(o) for o in operands[:4])
            entry.key_cache, entry.value_cache = self._address(key_cache), self._address(value_cache)
            self._qwen3_parts(entry, layer, operands[4:])
        # This rank's shard under tensor parallelism (the whole model without): its eager layers' sizes.
        attention = model.layers[0].self_attn
        dense = [layer.mlp for layer in model.layers if not isinstance(layer.mlp, SparseMoeBlock)]
        self.tp = tp  # kept alive with the plan, which points at it
        self.plan = cpu_native.DecodeModel(
            num_layers=len(model.layers), hidden=config.hidden_size, heads=attention.num_heads,
            kv_heads=attention.num_kv_heads, head_dim=config.head_dim,
            intermediate=dense[0].intermediate_size if dense else config.intermediate_size // tp_size(),
            block_size=self.block_size,
            kv_bf16=int(kv_caches[0][0].dtype == torch.bfloat16), eps=config.rms_norm_eps,
            scale=model.layers[0].self_attn.scale, layers=self._layers,
            final_norm=self._address(model.norm.weight.to(torch.float32).contiguous()),
            tp=None if tp is None else ctypes.pointer(tp))
        self.scratch = cpu_native.decode_scratch(library, self.plan, max_rows)
        self._lora(lora)

    def _lora(self, lora) -> None:
        """The LoRA adapters (``_lora_operands``): None (no wrapped layer), or the step's rows
        (``LoRAStep``) with every wrapped layer's slots (or why they cannot be held). Steps with
        adapted rows set ``plan.lora`` to them (each row's slot copied into the plan's buffer);
        the others leave it NULL, the base step unchanged."""
        self.lora_rows = None if lora is None else lora[0]
        self._lora_plan = None
        if lora is None or isinstance(lora[1], str):
            return
        rank, slots = lora[1]
        self._lora_linears = (cpu_native.LoRASlots * len(slots))(*slots)
        self._lora_slots = torch.full((self.max_rows,), -1, dtype=torch.int32)
        scratch = torch.empty(self.max_rows * cpu_native.LORA_MAX_SLICES * rank, dtype=torch.float32)
        self._keep += [self._lora_slots, scratch]
        self._lora_plan = ctypes.pointer(cpu_native.DecodeLoRA(rank, self._lora_slots.data_ptr(), scratch.data_ptr(),
                                                               self._lora_linears))

    def _address(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _linear(self, operands: cpu_native.LinearOperands | None) -> cpu_native.DecodeLinear:
        if operands is None:  # a sparse layer's dense MLP slots, or no shared expert
            return cpu_native.DecodeLinear()
        return cpu_native.DecodeLinear(operands.format, *(self._address(t) for t in (
            operands.weight, operands.bias, operands.scale, operands.offset)), operands.dot_rows)

    def _qwen3_parts(self, entry: cpu_native.DecodeLayer, layer, sparse_linears: list) -> None:
        """Qwen3's per-head q / k norms and a Qwen3-MoE / Qwen2-MoE sparse MLP (checked at
        ``capture``: ``_sparse_reason``); ``sparse_linears``: its router's operands, then its
        shared expert's gate_up, down and gate, if it has one."""
        attention = layer.self_attn
        if attention.q_norm is not None:
            entry.q_norm, entry.k_norm = (self._address(norm.weight.to(torch.float32).contiguous())
                                          for norm in (attention.q_norm, attention.k_norm))
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoeBlock):
            return
        experts, (router, *shared) = mlp.experts, sparse_linears
        shared_gate_up, shared_down, shared_gate = (self._linear(o) for o in shared or (None,) * 3)
        sparse = cpu_native.DecodeMoe(
            num_experts=experts.num_experts, top_k=mlp.top_k, intermediate=experts.intermediate_size,
            renormalize=int(mlp.renormalize), router=self._linear(router),
            w13=self._address(experts.w13.detach()), w2=self._address(experts.w2.detach()),
            shared_intermediate=mlp.shared_expert.intermediate_size if shared else 0,
            shared_gate_up=shared_gate_up, shared_down=shared_down, shared_gate=shared_gate)
        self._sparse.append(sparse)
        entry.moe = ctypes.pointer(sparse)

    def applies(self, kv_caches, metadata: AttentionMetadata) -> bool:
        """A decode-only step (one new token per request) of at most ``max_rows`` requests over
        the captured caches, with the native kernels still chosen (``ATB_PLUGIN_CPU_KERNELS`` is
        read every step, as the eager ops read it); a step with LoRA-adapted rows where the plan
        holds the adapters, one row per request."""
        adapted = self.lora_rows.row_slots if self.lora_rows is not None else None
        if adapted is not None and (self._lora_plan is None or adapted.numel() != metadata.num_reqs):
            return False  # adapters the plan cannot hold: the eager layers add them
        return (metadata.is_decode_only and metadata.num_reqs <= self.max_rows
                and int(metadata.query_start_loc_cpu[-1]) == metadata.num_reqs
                and kv_caches is self.kv_caches
                and cpu_native.linear_library(torch.device("cpu")) is self.library)

    def __call__(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """The final hidden states in ``embeds``' dtype (the model's); computed in float32."""
        rows = metadata.num_reqs
        tables, seq_lens, slots = metadata.block_tables, metadata.seq_lens, metadata.slot_mapping
        # What the kernel trusts, checked once per step (the eager kernels check the same per call).
        if (embeds.shape != (rows, self.hidden) or embeds.dtype not in CACHE_DTYPES
                or cos.shape != (rows, self.head_dim) or sin.shape != cos.shape):
            raise ValueError(f"captured decode step: embeddings {tuple(embeds.shape)} {embeds.dtype}, rotary "
                             f"{tuple(cos.shape)} for {rows} requests of hidden size {self.hidden}")
        if (tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or slots.dtype != torch.int64
                or tables.dim() != 2 or tables.shape[0] != rows or slots.shape != (rows,)):
            raise ValueError("captured decode step: block tables / seq_lens int32 and slots int64, one row per "
                             "request")
        if int(tables.max()) >= self.num_blocks or int(slots.max()) >= self.num_blocks * self.block_size:
            raise IndexError(f"captured decode step: a block or slot past the cache's {self.num_blocks} blocks")
        if int(seq_lens.min()) < 1 or int(seq_lens.max()) > tables.shape[1] * self.block_size:
            raise IndexError("captured decode step: a sequence longer than its block table")
        adapted = self.lora_rows.row_slots if self.lora_rows is not None else None
        if adapted is not None:
            self._lora_slots[:rows].copy_(adapted)
        self.plan.lora = None if adapted is None else self._lora_plan
        f32 = [t.to(torch.float32).contiguous() for t in (embeds, cos, sin)]
        out = cpu_native.decode_step(self.library, self.plan, *f32, slots.contiguous(), tables.contiguous(),
                                     seq_lens.contiguous(), self.scratch)
        return out.to(embeds.dtype)


def _sparse_reason(mlp: SparseMoeBlock) -> str | None:
    """Why a sparse MLP cannot enter the plan (its grouped experts: csrc/moe_kernels.c), or None."""
    experts = mlp.experts
    if experts.first_expert or experts.num_local_experts != experts.num_experts:
        return "expert parallelism: this rank holds only some experts"
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
           for w in (experts.w13, experts.w2)):
        # bfloat16 experts would need a bfloat16 grouped kernel; they stay eager (torch._grouped_mm).
        return (f"mixture-of-experts layers with {experts.w13.dtype} experts: the plan's grouped expert kernel "
                "reads float32 experts only")
    return None


def _native_form(linear) -> cpu_native.LinearOperands | str:
    """A linear layer's operands for the plan: a model linear through its method; a router or
    shared-expert gate (a plain module the packing pass turned into panels) as its panels."""
    if hasattr(linear, "quant_method"):
        return linear.quant_method.native_operands(linear)
    if hasattr(linear, "native_operands"):
        return linear.native_operands()
    return f"{type(linear).__name__} has no native form (pack_weights off, or a format the plan lacks)"


def _mlp_linears(layer) -> tuple:
    """The MLP linear layers the plan holds: a dense MLP's gate_up / down, or for a sparse layer
    none in those slots, then its router, and its shared expert's gate_up, down and gate, if any."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoeBlock):
        return mlp.gate_up_proj, mlp.down_proj
    shared = mlp.shared_expert
    return (None, None, mlp.gate) + (() if shared is None else (
        shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate))


def _operands(layer) -> list[cpu_native.LinearOperands | None] | str:
    """The layer's linear layers as the plan takes them (qkv, o, gate_up, down, then a sparse
    layer's router and shared expert linears; None: a slot a sparse layer leaves empty), or why one
    cannot be captured."""
    if isinstance(layer.mlp, SparseMoeBlock) and (why := _sparse_reason(layer.mlp)):
        return why
    found = []
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *_mlp_linears(layer)):
        if linear is None:
            found.append(None)
            continue
        operands = _native_form(linear)
        if isinstance(operands, str):
            return f"a linear layer cannot be captured: {operands}"
        found.append(operands)
    return found


def _lora_operands(layers):
    """The LoRA side of the plan: None where no linear layer is LoRA-wrapped, else (the step's
    rows, ``LoRAStep``; (rank, the four wrapped layers' slots per decoder layer) or why the plan
    cannot hold them). A wrapped layer names them itself (lora/layers.py, ``native_lora``)."""
    # A sparse MoE layer has no gate_up / down of its own (its experts are not adapted): None
    # there makes such a model's adapted steps run eager ("only some linear layers").
    found = [getattr(linear, "native_lora", None) for layer in layers for linear in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None),
        getattr(layer.mlp, "down_proj", None))]
    described = [native_lora() for native_lora in found if native_lora is not None]
    if not described:
        return None
    steps, ranks = {id(step) for _, _, step in described}, {rank for _, rank, _ in described}
    why = next((slots for slots, _, _ in described if isinstance(slots, str)), None)
    if why is None and (len(described) != len(found) or len(steps) != 1 or len(ranks) != 1):
        why = "only some linear layers LoRA-wrapped, or of different steps or ranks"
    return described[0][2], why or (ranks.pop(), [slots for slots, _, _ in described])


def capture(model, kv_caches, max_rows: int) -> tuple[NativeDecodeStep | None, str]:
    """A ``NativeDecodeStep`` over ``model`` (a ``decoder.DecoderModel``) and its caches, or None
    and why the decode step stays eager (a dtype or layout the plan cannot hold; no native kernels).
    The model runner asks only on a platform that ``captures_decode_step``; under tensor
    parallelism every rank asks, and all get the same answer (``_agree``)."""
    step, outcome = _capture(model, kv_caches, max_rows)
    return (step, outcome) if tp_size() == 1 else _agree(step, outcome)


def _agree(step: NativeDecodeStep | None, outcome: str) -> tuple[NativeDecodeStep | None, str]:
    """Every rank's capture, or none: a captured rank runs its all-reduces inside its native step,
    so the ranks must agree on which steps run captured, and a rank must never wait in a native
    all-reduce the others do not enter. The first refusing rank's reason, on every rank."""
    outcomes = all_gather_object(outcome)
    refused = next((rank for rank, said in enumerate(outcomes) if said != "captured"), None)
    if refused is None:
        return step, outcome
    return None, outcomes[refused] if refused == tp_rank() else f"tensor-parallel rank {refused}: {outcomes[refused]}"


def _tp_operands(hidden: int, max_rows: int) -> tuple[cpu_native.DecodeTP | None, int] | str:
    """This rank's exchange for the plan's all-reduces and the rows its slots hold at ``hidden``
    float32 features (None, ``max_rows`` without tensor parallelism), or why it has none."""
    if tp_size() == 1:
        return None, max_rows
    found = native_exchange()
    if found is None:
        return ("tensor parallel without the shared-memory exchange (ranks on several nodes, or a CPU whose store "
                "order it cannot rely on): the plan has no collective of its own")
    exchange, timeout_s = found
    rows = min(max_rows, exchange.slot_bytes // (4 * hidden))
    if rows < 1:
        return f"hidden size {hidden} in float32 does not fit the exchange's {exchange.slot_bytes}-byte slots"
    return cpu_native.DecodeTP(exchange.address, exchange.rank, exchange.size, exchange.slot_bytes, timeout_s), rows


def _capture(model, kv_caches, max_rows: int) -> tuple[NativeDecodeStep | None, str]:
    """``capture`` on this rank alone."""
    weight = model.embed_tokens.weight
    library = cpu_native.linear_library(weight.device)  # None off the CPU or with the torch ops chosen
    if library is None:
        return None, f"the native CPU kernels are not in use ({weight.device}, {cpu_native.KERNELS_ENV}={cpu_native.choice()})"
    if model.config.head_dim % cpu_native.DECODE_HEAD_DIM_MULTIPLE:
        return None, f"head_dim {model.config.head_dim} is not a multiple of {cpu_native.DECODE_HEAD_DIM_MULTIPLE}"
    if len(kv_caches) != len(model.layers) or max_rows < 1:
        return None, f"{len(kv_caches)} caches for {len(model.layers)} layers, max_rows {max_rows}"
    caches = [cache for pair in kv_caches for cache in pair]
    if (caches[0].dtype not in CACHE_DTYPES or any(c.dtype != caches[0].dtype or not c.is_contiguous() for c in caches)
            or any(c.device.type != "cpu" for c in caches)):
        return None, f"the KV caches are not contiguous CPU {' / '.join(map(str, CACHE_DTYPES))}"
    linears = []
    for layer in model.layers:
        operands = _operands(layer)
        if isinstance(operands, str):
            return None, operands
        linears.append(operands)
    # A layer whose batches take another form (packed_linear.SplitLinear): larger steps run eager.
    split = [o.batch_rows for layer in linears for o in layer if o is not None and o.batch_rows]
    if split and min(split) <= 1:
        return None, "the linear layers' forms for one row are not the panels"
    max_rows = min([max_rows, *(rows - 1 for rows in split)])
    tp = _tp_operands(model.config.hidden_size, max_rows)
    if isinstance(tp, str):
        return None, tp
    return NativeDecodeStep(library, model, kv_caches, tp[1], linears, _lora_operands(model.layers), tp[0]), "captured"
