"""Qwen-VL on its tiny checkpoint: loading under the published names, the vision tower's shapes,
parity with an independent reference, the paged path, and where the image features land.

Qwen-VL is not in transformers, so the reference here is written directly from the published
remote code's formulas (``visual.py``: VisualAttention's per-head fused in_proj, Resampler with
``nn.MultiheadAttention``, get_abs_pos; ``modeling_qwen.py``: RMSNorm, c_attn split, rotate-half
RoPE, ``c_proj(w1(x) * silu(w2(x)))``), in plain torch over the checkpoint's own tensors and names,
sharing no code with ``atb_plugin``. Pixels for the reference come from transformers'
``CLIPImageProcessorPil`` (Qwen-VL's transform: 448x448 bicubic, CLIP mean/std, no crop).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

from atb_plugin.models.weights import WeightLoadingError
from atb_plugin.multimodal import MultimodalPrompt
from atb_plugin.testing.sequence import SequenceRunner
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.media_config import MediaConfig
from routers import get_router
from tests.helpers import copy_checkpoint

TOLERANCE = 1e-4  # whole-model logits, fp32
TIGHT = 1e-5  # one component (vision tower, one decoder layer)


pytestmark = pytest.mark.usefixtures("atb_kernel_set")


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen_vl")


@pytest.fixture(scope="module")
def model(path):
    return get_router(path).model_cls.from_pretrained(path)


@pytest.fixture(scope="module")
def state(path):
    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def raw(path):
    return get_router(path).raw_config


def build_prompt(path, store, tmp_path, image_paths, text="What is in the picture?") -> list[int]:
    media = MediaConfig(allowed_local_media_paths=(str(tmp_path),))
    router = get_router(path, shm_store=store, media_config=media)
    chat = [{"role": "user", "content": [{"image": str(p)} for p in image_paths] + [{"text": text}]}]
    return router.input_builder.make_context(0, chat, request_id="r")


def reference_pixels(image_path) -> torch.Tensor:
    from transformers import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"height": 448, "width": 448}, do_center_crop=False)
    image = Image.open(image_path).convert("RGB")
    return torch.from_numpy(processor(images=[image], return_tensors="np")["pixel_values"])


# ---------------------------------------------------------------------------------------------
# the independent reference (plain torch, checkpoint names, the remote code's formulas)


def ref_get_abs_pos(abs_pos, tgt_size):
    src, tgt = int(math.sqrt(abs_pos.size(0))), int(math.sqrt(tgt_size))
    if src == tgt:
        return abs_pos
    grid = abs_pos.float().reshape(1, src, src, -1).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=(tgt, tgt), mode="bicubic", align_corners=False).permute(0, 2, 3, 1).flatten(0, 2)


def ref_visual(sd, raw, pixels):
    """visual.VisionTransformer.forward for a batch ``(N, 3, H, W)`` -> ``(N, 256, output_dim)``."""
    vis = raw["visual"]
    v = "transformer.visual."
    width, heads, out_dim = vis["width"], vis["heads"], vis["output_dim"]
    hn = width // heads

    def ln(x, name):
        return F.layer_norm(x, (x.shape[-1],), sd[name + ".weight"], sd[name + ".bias"], 1e-6)

    x = F.conv2d(pixels, sd[v + "conv1.weight"], stride=vis["patch_size"])  # [*, width, grid, grid]
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [*, grid ** 2, width]
    x = x + ref_get_abs_pos(sd[v + "positional_embedding"], x.size(1))
    x = ln(x, v + "ln_pre").permute(1, 0, 2)  # NLD -> LND
    for i in range(vis["layers"]):
        block = f"{v}transformer.resblocks.{i}."
        h = ln(x, block + "ln_1")
        sq, b, _ = h.shape
        mixed = F.linear(h, sd[block + "attn.in_proj.weight"], sd[block + "attn.in_proj.bias"])
        mixed = mixed.view(sq, b, heads, 3 * hn)  # [sq, b, np, 3 * hn]
        q, k, val = mixed.split(hn, dim=-1)
        q = q.reshape(sq, b * heads, hn).transpose(0, 1)
        k = k.reshape(sq, b * heads, hn).transpose(0, 1)
        val = val.reshape(sq, b * heads, hn).transpose(0, 1)
        probs = torch.bmm(q / math.sqrt(hn), k.transpose(-2, -1)).softmax(dim=-1)
        context = torch.bmm(probs, val).view(b, heads, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, width)
        x = x + F.linear(context, sd[block + "attn.out_proj.weight"], sd[block + "attn.out_proj.bias"])
        h = ln(x, block + "ln_2")
        h = F.gelu(F.linear(h, sd[block + "mlp.c_fc.weight"], sd[block + "mlp.c_fc.bias"]))
        x = x + F.linear(h, sd[block + "mlp.c_proj.weight"], sd[block + "mlp.c_proj.bias"])
    x = x.permute(1, 0, 2)  # LND -> NLD
    # Resampler
    a = v + "attn_pool."
    pos_embed = sd[a + "pos_embed"]
    pos = ref_get_abs_pos(pos_embed, x.size(1))
    kv = ln(F.linear(x, sd[a + "kv_proj.weight"]), a + "ln_kv").permute(1, 0, 2)
    n = kv.shape[1]
    query = ln(sd[a + "query"], a + "ln_q")
    attn = torch.nn.MultiheadAttention(out_dim, out_dim // 128)
    attn.load_state_dict({name: sd[a + "attn." + name] for name in
                          ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")})
    with torch.no_grad():
        out = attn(query.unsqueeze(1).repeat(1, n, 1) + pos_embed.unsqueeze(1), kv + pos.unsqueeze(1), kv)[0]
    x = out.permute(1, 0, 2)
    return ln(x, v + "ln_post") @ sd[v + "proj"]


def ref_rotary(raw, length):
    dim = raw["kv_channels"]
    inv_freq = 1.0 / (raw["rotary_emb_base"] ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(length).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # 1 n 1 d
    return emb.cos(), emb.sin()


def ref_rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def ref_block(sd, raw, i, hidden):
    """QWenBlock.forward over ``(1, T, hidden)`` from position 0, causal."""
    pre, eps = f"transformer.h.{i}.", raw["layer_norm_epsilon"]
    heads, hd, size = raw["num_attention_heads"], raw["kv_channels"], raw["hidden_size"]
    t = hidden.shape[1]
    cos, sin = ref_rotary(raw, t)

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    x = ref_rms(hidden, sd[pre + "ln_1.weight"], eps)
    query, key, value = F.linear(x, sd[pre + "attn.c_attn.weight"], sd[pre + "attn.c_attn.bias"]).split(size, dim=2)
    query, key = rope(query.view(1, t, heads, hd)), rope(key.view(1, t, heads, hd))
    value = value.view(1, t, heads, hd)
    weights = torch.matmul(query.transpose(1, 2), key.transpose(1, 2).transpose(-1, -2)) / hd**0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    weights = torch.where(causal, weights, torch.finfo(weights.dtype).min).softmax(dim=-1)
    context = torch.matmul(weights, value.transpose(1, 2)).transpose(1, 2).reshape(1, t, size)
    hidden = hidden + F.linear(context, sd[pre + "attn.c_proj.weight"])
    x = ref_rms(hidden, sd[pre + "ln_2.weight"], eps)
    a1, a2 = F.linear(x, sd[pre + "mlp.w1.weight"]), F.linear(x, sd[pre + "mlp.w2.weight"])
    return hidden + F.linear(a1 * F.silu(a2), sd[pre + "mlp.c_proj.weight"])


def ref_logits(sd, raw, embeds):
    hidden = embeds[None]
    for i in range(raw["num_hidden_layers"]):
        hidden = ref_block(sd, raw, i, hidden)
    hidden = ref_rms(hidden, sd["transformer.ln_f.weight"], raw["layer_norm_epsilon"])
    return (hidden @ sd["lm_head.weight"].t())[0]


def ref_embeds(sd, raw, ids, pixel_list):
    """wte lookup with each image's 256 features written between its <img> and </img>."""
    start_id = raw["visual"]["image_start_id"]
    embeds = sd["transformer.wte.weight"][ids.clamp(min=0)].clone()
    starts = (ids == start_id).nonzero().flatten().tolist()
    ends = (ids == start_id + 1).nonzero().flatten().tolist()
    assert len(starts) == len(ends) == len(pixel_list)
    for a, b, pixels in zip(starts, ends, pixel_list):
        embeds[a + 1:b] = ref_visual(sd, raw, pixels)[0]
    return embeds


# ---------------------------------------------------------------------------------------------
# loading


def test_loads_every_published_name(model, state, path):
    assert all(model.accepts_weight(name) for name in state)
    fresh = get_router(path).model_cls.from_pretrained(path)  # load_checkpoint: no missing, no unexpected
    loaded = fresh.load_weights(state.items())
    assert loaded == {name for name, _ in fresh.named_parameters()}
    assert not model.accepts_weight("transformer.visual.attn_pool.extra")
    assert not model.accepts_weight("transformer.h.99.ln_1.weight")  # beyond num_hidden_layers


def test_fused_projections_follow_qwens_mlp(model, state, raw):
    layer = model.language_model.model.layers[1]
    f = raw["intermediate_size"] // 2
    gate_up = layer.mlp.gate_up_proj.weight
    assert torch.equal(gate_up[:f], state["transformer.h.1.mlp.w2.weight"])  # silu(w2(x)): the gate
    assert torch.equal(gate_up[f:], state["transformer.h.1.mlp.w1.weight"])
    assert torch.equal(layer.self_attn.qkv_proj.bias, state["transformer.h.1.attn.c_attn.bias"])
    assert layer.self_attn.o_proj.bias is None
    text = model.config.text
    assert (text.head_dim, text.rms_norm_eps, text.rope["rope_theta"]) == (
        raw["kv_channels"], raw["layer_norm_epsilon"], raw["rotary_emb_base"])


def test_missing_and_unexpected_weights_are_named(tmp_path, path):
    copy_checkpoint(path, tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    sd.pop("transformer.h.0.mlp.w1.weight")
    sd.pop("transformer.visual.attn_pool.kv_proj.weight")
    sd["transformer.visual.extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadingError, match=(
            r"missing from the checkpoint: language_model\.model\.layers\.0\.mlp\.gate_up_proj\.weight, "
            r"visual\.attn_pool\.kv_proj\.weight; not used by the model: transformer\.visual\.extra\.weight")):
        get_router(tmp_path).model_cls.from_pretrained(tmp_path)


def test_a_wrong_shape_names_the_checkpoint_tensor(model, state):
    bad = state["transformer.h.0.mlp.w2.weight"][:-1]
    with pytest.raises(WeightLoadingError, match=r"transformer\.h\.0\.mlp\.w2\.weight: checkpoint shape"):
        model.load_weights([("transformer.h.0.mlp.w2.weight", bad)])


# ---------------------------------------------------------------------------------------------
# vision tower


def test_vision_shapes_patches_to_queries(model, raw):
    visual = model.visual
    pixels = torch.randn(1, 3, 448, 448, generator=torch.Generator().manual_seed(0))
    width, hidden = raw["visual"]["width"], raw["hidden_size"]
    with torch.no_grad():
        patches = visual.patch_embed(pixels)
        assert patches.shape == (1, 32 * 32, width)  # 448 / 14 = 32
        encoded = visual.encode_patches(patches)
        assert encoded.shape == (1, 1024, width)
        pooled = visual.attn_pool(encoded, 32)
        assert pooled.shape == (1, 256, hidden)
        features = model.get_multimodal_embeddings(pixels, None)
    assert features.shape == (256, hidden)
    layout = model.media_layout
    start = raw["visual"]["image_start_id"]
    assert (layout.placeholder_id, layout.num_metadata_slots, layout.tokens_per_block) == (start + 2, 2, 256)


@pytest.mark.parametrize("side", [448, 112])  # 112: an 8x8 grid, fewer patches (64) than queries (256)
def test_vision_tower_matches_the_reference(model, state, raw, side):
    pixels = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(side))
    with torch.no_grad():
        ours = model.visual(pixels)
        expected = ref_visual(state, raw, pixels)
        single = model.get_multimodal_embeddings(pixels[1:], None)
    assert ours.shape == expected.shape == (2, 256, raw["hidden_size"])
    assert (ours - expected).abs().max() <= TIGHT
    assert (single - expected[1]).abs().max() <= TIGHT  # images in a batch do not see each other


def test_vision_rejects_non_square_pixels(model):
    with pytest.raises(ValueError, match="square"):
        model.visual(torch.zeros(1, 3, 448, 434))


# ---------------------------------------------------------------------------------------------
# language model


def test_one_decoder_layer_matches_the_reference(model, state, raw):
    from atb_plugin.ops import AttentionMetadata

    t, size = 19, raw["hidden_size"]
    hidden = torch.randn(t, size, generator=torch.Generator().manual_seed(3))
    lm = model.language_model
    cos, sin = lm.model.rotary.cos_sin(torch.arange(t), hidden.dtype)
    kv_cache = lm.make_kv_caches(1 + -(-t // 4), 4)[0]
    with torch.no_grad():
        ours = lm.model.layers[0](hidden, cos, sin, kv_cache, AttentionMetadata.for_prefill([t], 4))
        expected = ref_block(state, raw, 0, hidden[None])[0]
    assert (ours - expected).abs().max() <= TIGHT


def test_text_logits_match_the_reference(model, state, raw):
    ids = torch.randint(0, raw["vocab_size"], (23,), generator=torch.Generator().manual_seed(0))
    got = SequenceRunner(model, max_len=32).step(ids)
    with torch.no_grad():
        expected = ref_logits(state, raw, state["transformer.wte.weight"][ids])
    assert (got - expected).abs().max() <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# with images: the real input builder + MultimodalPrompt


def test_prompt_with_images_matches_the_reference(model, state, raw, path, store, images, tmp_path):
    ids = build_prompt(path, store, tmp_path, images)
    mm = MultimodalPrompt.from_ids(ids, model.media_layout)
    length = mm.token_ids.shape[0]
    got = SequenceRunner(model, max_len=length).step(mm.token_ids, inputs_embeds=mm.embed(model, 0, length))
    with torch.no_grad():
        expected = ref_logits(state, raw, ref_embeds(state, raw, mm.token_ids, [reference_pixels(p) for p in images]))
    assert (got - expected).abs().max() <= TOLERANCE
    store.release("r")


def test_image_features_fill_exactly_the_256_slots(model, raw, path, store, images, tmp_path):
    ids = build_prompt(path, store, tmp_path, images)
    mm = MultimodalPrompt.from_ids(ids, model.media_layout)
    tokens = mm.token_ids
    start_id = raw["visual"]["image_start_id"]
    starts = (tokens == start_id).nonzero().flatten().tolist()
    ends = (tokens == start_id + 1).nonzero().flatten().tolist()
    assert len(starts) == len(ends) == len(mm.blocks) == 2
    embeds = mm.embed(model)
    with torch.no_grad():
        text = model.get_input_embeddings(tokens)
    is_image = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for a, b, block in zip(starts, ends, mm.blocks):
        assert (block.start, block.length) == (a + 1, b - a - 1) == (a + 1, 256)
        assert bool((tokens[a + 1:b] == start_id + 2).all())  # NAME, SHAPE restored to <imgpad>
        with torch.no_grad():
            features = model.get_multimodal_embeddings(model.encoder_input(block.pixel_values), None)
        assert torch.equal(embeds[a + 1:b], features)
        is_image[a + 1:b] = True
    assert int(is_image.sum()) == 512
    assert torch.equal(embeds[~is_image], text[~is_image])  # <img>, </img> and all text untouched
    store.release("r")


def test_paged_decode_and_chunked_prefill_across_the_image_equal_the_full_forward(model, path, store, images, tmp_path):
    ids = build_prompt(path, store, tmp_path, images[:1])
    mm = MultimodalPrompt.from_ids(ids, model.media_layout)
    prompt_len = mm.token_ids.shape[0]
    continuation = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    tokens = torch.cat([mm.token_ids, continuation])
    total = tokens.shape[0]
    embeds = torch.cat([mm.embed(model, 0, prompt_len), model.get_input_embeddings(continuation)])
    full = SequenceRunner(model, max_len=total).step(tokens, inputs_embeds=embeds)

    # prefill in one step, then token-by-token decode
    runner = SequenceRunner(model, max_len=total, block_size=16)
    pieces = [runner.step(mm.token_ids, inputs_embeds=mm.embed(model, 0, prompt_len))]
    pieces += [runner.step(continuation[i:i + 1]) for i in range(continuation.shape[0])]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE

    # chunked prefill with boundaries inside the image block (and one right after <img>)
    block = mm.blocks[0]
    cuts = [0, block.start - 3, block.start, block.start + 100, block.start + 250, prompt_len]
    runner = SequenceRunner(model, max_len=total, block_size=4)
    pieces = [runner.step(mm.token_ids[a:b], inputs_embeds=mm.embed(model, a, b)) for a, b in zip(cuts, cuts[1:])]
    pieces += [runner.step(continuation[i:i + 1]) for i in range(continuation.shape[0])]
    assert (torch.cat(pieces) - full).abs().max() <= TOLERANCE
    store.release("r")


def test_npu_path_equals_the_cpu_path(model):
    """The same model on the NPU kernels (simulated torch_npu): the ViT and the resampler's
    cross-attention run on ``_npu_flash_attention_unpad``, the LM on ATB's paged ops."""
    from atb_plugin.platform import reset_current_platform, use_platform
    from atb_plugin.testing import fake_torch_npu

    gen = torch.Generator().manual_seed(5)
    pixels = torch.randn(1, 3, 448, 448, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=gen)
    runs = {}
    # About the resampler / tower paths, not precision: fp32 on the simulated NPU, opted in explicitly.
    fake = fake_torch_npu.install(allow_fp32_attention=True)
    try:
        for platform in ("cpu", "npu"):
            with use_platform(platform), torch.no_grad():
                runner = SequenceRunner(model, max_len=64, block_size=16)  # ATB: block_size % 16 == 0
                logits = torch.cat([runner.step(ids[:30]), runner.step(ids[30:31]), runner.step(ids[31:])])
                runs[platform] = (model.get_multimodal_embeddings(pixels, None), logits)
        calls = dict(fake.module.calls)
    finally:
        fake.uninstall()
        reset_current_platform()
    assert calls["_npu_flash_attention_unpad"] == model.config.vision.layers + 1  # + the resampler
    assert calls["_npu_paged_attention"] > 0 and calls["_npu_reshape_and_cache"] > 0
    assert (runs["npu"][0] - runs["cpu"][0]).abs().max() <= TIGHT
    assert (runs["npu"][1] - runs["cpu"][1]).abs().max() <= TOLERANCE
