"""Start-up memory profiling and KV sizing (atb_plugin.engine.memory_profile, EngineCore's
``Worker._blocks_for_budget``): each multimodal family declares its image limit and its largest image;
the dummy prompt is that image, min(model, user) times; on a device the KV cache gets what the
profile leaves of ``gpu_memory_utilization``, on the CPU ``kv_cache_bytes``.

Device memory is simulated on the CPU with ``AllocationMeter``: the live bytes of every tensor
storage made under it, exact and deterministic (the process's resident memory is neither)."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from atb_plugin.engine import worker as worker_module
from atb_plugin.engine import memory_profile
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.memory_profile import dummy_inputs
from atb_plugin.models import registry
from atb_plugin.models.interfaces import MultimodalProcessingInfo
from atb_plugin.multimodal.prompt import encode_pixels
from atb_plugin.platform.cpu import CpuPlatform
from atb_plugin.server.cli import parse_config
from atb_plugin.testing.tiny import tiny_checkpoint
from input_builders.llava import LlavaInputBuilder
from input_builders.preprocess import MAX_ASPECT_RATIO, Qwen2VLPreprocessor
from input_builders.qwen2_vl import Qwen2VlInputBuilder
from input_builders.qwen_vl import QwenVlInputBuilder

ROOT = Path(__file__).resolve().parents[1]
MULTIMODAL = ["qwen2_vl", "qwen2_5_vl", "llava", "qwen_vl"]
MiB = 1 << 20


# -- what each family declares -----------------------------------------------------------------


def test_qwen2_vl_declares_the_image_with_the_most_tokens(models):
    model_dir = tiny_checkpoint("qwen2_vl")
    info = models("qwen2_vl").get_processing_info(model_dir)
    # The builder's own preprocessing of that size: unchanged by smart_resize, max_tokens_per_item tokens.
    preprocessor = Qwen2VLPreprocessor.from_config(json.loads((model_dir / "preprocessor_config.json").read_text()))
    height, width = info.max_item_size
    assert preprocessor.smart_resize(height, width) == (height, width)
    grid = (1, height // 14, width // 14)
    assert grid == info.grid_thw and preprocessor.num_image_tokens(grid) == info.max_tokens_per_item
    assert info.max_tokens_per_item == preprocessor.max_pixels // 28**2 == 256  # tiny: 28 * 28 * 256 pixels
    assert info.pixel_shape == (16 * 64, 3 * 2 * 14 * 14)
    # A smaller image gives fewer tokens; a larger one is scaled down to no more.
    smaller = preprocessor.smart_resize(height - 28, width)
    assert preprocessor.num_image_tokens((1, smaller[0] // 14, smaller[1] // 14)) < info.max_tokens_per_item
    for size in [(4000, 3000), (height * 2, width), (999, 1001), (300, 9000)]:
        h, w = preprocessor.smart_resize(*size)
        assert preprocessor.num_image_tokens((1, h // 14, w // 14)) <= info.max_tokens_per_item


def test_qwen2_vl_largest_image_need_not_be_square(models, tmp_path):
    # transformers' default max_pixels is 1280 merge windows: 32 x 40 of them (1280 tokens) beats
    # the square 35 x 35 (1225). Without a preprocessor config, the builder's default applies.
    from atb_plugin.models import qwen2_vl

    assert qwen2_vl.DEFAULT_MAX_PIXELS == Qwen2VLPreprocessor().max_pixels
    assert qwen2_vl.MAX_ASPECT_RATIO == MAX_ASPECT_RATIO
    info = models("qwen2_vl").get_processing_info(tmp_path)  # no preprocessor_config.json there
    assert info.max_tokens_per_item == 1280 and info.max_item_size == (32 * 28, 40 * 28)
    preprocessor = Qwen2VLPreprocessor()
    assert preprocessor.smart_resize(*info.max_item_size) == info.max_item_size
    # The builder's precedence: top-level max_pixels, then size.longest_edge.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"longest_edge": 28 * 28 * 6}}))
    assert models("qwen2_vl").get_processing_info(tmp_path).max_tokens_per_item == 6


@pytest.mark.parametrize("wire_dtype", ["uint8", "float32"])
@pytest.mark.parametrize("family", MULTIMODAL)
def test_the_dummy_item_encodes_to_the_declared_tokens(models, family, wire_dtype):
    model = models(family)
    config = EngineConfig(tiny_checkpoint(family), kv_cache_blocks=8, mm_wire_dtype=wire_dtype)
    inputs = dummy_inputs(model, config)
    info = model.get_processing_info(config.model)
    assert inputs.num_items == config.limit_mm_per_prompt == info.max_items_per_prompt
    # The worst-case item in the configured wire form: the uint8 image or the float32 values.
    pixels = inputs.item.pixel_values
    assert pixels.dtype == getattr(torch, wire_dtype)
    assert tuple(pixels.shape) == ((*info.max_item_size, 3) if wire_dtype == "uint8" else info.pixel_shape)
    with torch.no_grad():
        rows = encode_pixels(model, pixels, inputs.item.grid_thw)
    assert rows.shape[0] == info.max_tokens_per_item == model.media_layout.block_length(info.grid_thw)
    placeholders = int((inputs.input_ids == model.media_layout.placeholder_id).sum())
    assert inputs.num_tokens == min(config.max_num_batched_tokens, config.max_model_len)
    assert placeholders == min(inputs.num_tokens, inputs.feature_tokens)


def test_processing_info_is_validated():
    with pytest.raises(ValueError, match="max_items_per_prompt"):
        MultimodalProcessingInfo("image", 0, 16, (56, 56), (1, 3, 56, 56))
    with pytest.raises(ValueError, match="grid_thw"):
        MultimodalProcessingInfo("image", 4, 16, (56, 56), (17, 1176), grid_thw=(1, 4, 4))
    with pytest.raises(ValueError, match="modality"):
        MultimodalProcessingInfo("hologram", 4, 16, (56, 56), (1, 3, 56, 56))


# -- the limit: min(model, user), one declaration -----------------------------------------------


def test_the_limit_is_the_model_s_unless_the_user_lowers_it(models):
    assert EngineConfig(tiny_checkpoint("qwen2_vl"), kv_cache_blocks=8).limit_mm_per_prompt == 16
    assert EngineConfig(tiny_checkpoint("llava"), kv_cache_blocks=8).limit_mm_per_prompt == 4
    assert EngineConfig(tiny_checkpoint("qwen2"), kv_cache_blocks=8).limit_mm_per_prompt == 0
    lowered = EngineConfig(tiny_checkpoint("qwen2_vl"), kv_cache_blocks=8, limit_mm_per_prompt=3)
    assert lowered.limit_mm_per_prompt == 3 and dummy_inputs(models("qwen2_vl"), lowered).num_items == 3
    assert dummy_inputs(models("qwen2_vl"), lowered.replace(limit_mm_per_prompt=0)).item is None
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt = 5 .*at most 4 images"):
        EngineConfig(tiny_checkpoint("llava"), kv_cache_blocks=8, limit_mm_per_prompt=5)
    with pytest.raises(ValueError, match="takes no images"):
        EngineConfig(tiny_checkpoint("qwen2"), kv_cache_blocks=8, limit_mm_per_prompt=1)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineConfig(tiny_checkpoint("qwen2_vl"), kv_cache_blocks=8, limit_mm_per_prompt=-1)


@pytest.mark.parametrize("builder, family", [(Qwen2VlInputBuilder, "qwen2_vl"), (LlavaInputBuilder, "llava"),
                                             (QwenVlInputBuilder, "qwen_vl")])
def test_the_input_builders_read_the_model_s_limit(builder, family):
    model_cls = registry.import_model_class(registry.MODEL_CLASSES[family])
    assert builder.family_max_images() == model_cls.supported_mm_limits["image"] > 0


def test_a_builder_enforces_the_engine_s_limit_and_refuses_more_than_the_family_s():
    from routers import get_router

    model = tiny_checkpoint("llava")
    assert get_router(model).input_builder.max_images_per_prompt == 4
    assert get_router(model, max_images_per_prompt=2).input_builder.max_images_per_prompt == 2
    with pytest.raises(ValueError, match="0 to 4 images"):
        get_router(model, max_images_per_prompt=5).input_builder  # noqa: B018 - built on first use


def test_the_server_s_flags_reach_the_engine_config():
    server = parse_config(["--model", str(tiny_checkpoint("qwen2_vl")), "--limit-mm-per-prompt", "2",
                           "--gpu-memory-utilization", "0.5"])
    assert server.engine.limit_mm_per_prompt == server.limit_mm_per_prompt == 2
    assert server.engine.gpu_memory_utilization == 0.5
    assert parse_config(["--model", str(tiny_checkpoint("qwen2_vl"))]).limit_mm_per_prompt == 16
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="--gpu-memory-utilization"):
            parse_config(["--model", str(tiny_checkpoint("qwen2")), "--gpu-memory-utilization", bad])


# -- KV sizing ----------------------------------------------------------------------------------


class AllocationMeter(TorchDispatchMode):
    """Live bytes of the tensor storages made under it, and their peak: a simulated device's
    allocator stats (frees are seen at the next op, which is when the peak is read)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= size
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if storage._cdata not in self.live and storage.nbytes():
                    self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


@pytest.fixture
def simulated_device(monkeypatch):
    """The CPU platform as a device of ``simulated_device.total`` bytes whose memory stats are an
    ``AllocationMeter`` running from ``reset_peak_memory`` to ``peak_memory`` (the profile)."""

    class Device:
        total = 64 * MiB
        meter: AllocationMeter | None = None
        profiles = 0

    def reset_peak_memory(self):
        Device.meter = AllocationMeter()
        Device.meter.__enter__()
        Device.profiles += 1

    def peak_memory(self):
        Device.meter.__exit__(None, None, None)
        return Device.meter.peak

    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self: Device.total)
    monkeypatch.setattr(CpuPlatform, "reset_peak_memory", reset_peak_memory)
    monkeypatch.setattr(CpuPlatform, "memory_in_use", lambda self: Device.meter.now)
    monkeypatch.setattr(CpuPlatform, "peak_memory", peak_memory)
    return Device


def _core(family, **kwargs):
    return EngineCore(EngineConfig(tiny_checkpoint(family), device="cpu", **kwargs))


def test_on_a_device_the_kv_cache_shrinks_as_the_image_limit_grows(simulated_device, caplog):
    caplog.set_level(logging.INFO)
    # max_num_seqs high enough that the budget, not the full-length cap, sets the size.
    settings = dict(max_model_len=512, max_num_seqs=512, gpu_memory_utilization=1.0)
    sizes = {limit: _core("qwen2_vl", limit_mm_per_prompt=limit, **settings).kv_cache_blocks for limit in (1, 16)}
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K, V) x block x kv heads x head size x fp32
    # 15 more images hold 15 x 256 feature rows of 64 floats through the step.
    assert sizes[1] - sizes[16] >= 15 * 256 * 64 * 4 // bytes_per_block
    assert (sizes[16] - 1) * bytes_per_block < simulated_device.total
    assert "memory profile" in caplog.text and "1 x 64 MiB device memory" in caplog.text
    # A larger share of the device leaves more, text-only models are profiled on devices too.
    half = _core("qwen2_vl", limit_mm_per_prompt=16, **{**settings, "gpu_memory_utilization": 0.9})
    assert half.kv_cache_blocks < sizes[16]
    before = simulated_device.profiles
    assert _core("qwen2", **settings).kv_cache_blocks > sizes[1]
    assert simulated_device.profiles == before + 1


def test_a_max_model_len_the_kv_cache_cannot_hold_is_a_start_up_error(simulated_device, monkeypatch):
    # On the CPU: 4096 tokens = 256 blocks of 8 KiB = 2 MiB; 1 MiB of --kv-cache-memory is too little.
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self: None)
    with pytest.raises(ValueError, match=r"max_model_len 4096 needs 256 KV blocks x 8192 bytes = 2\.0 MiB.*"
                                         r"raise --kv-cache-memory"):
        _core("qwen2", kv_cache_bytes=1 * MiB)
    # On a device: what the profile (~9 MiB peak) leaves of 0.9 x 11 MiB, at most 0.7 MiB.
    monkeypatch.setattr(CpuPlatform, "total_memory", lambda self: 11 * MiB)
    with pytest.raises(ValueError, match=r"2\.0 MiB of KV cache.*0\.9 x 11 MiB device memory.*"
                                         r"raise --gpu-memory-utilization or lower --max-model-len"):
        _core("qwen2_vl")


def test_the_cpu_path_still_honours_kv_cache_bytes(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    # Multimodal models are profiled (and logged) on the CPU, but the budget stays kv_cache_bytes.
    assert _core("qwen2_vl", kv_cache_bytes=4 * MiB).kv_cache_blocks == 1 + 4 * MiB // 8192
    assert "memory profile" in caplog.text and "16 image(s) = 4096 feature tokens" in caplog.text

    def refused(*args):
        raise AssertionError("no profile expected")

    monkeypatch.setattr(memory_profile, "profile_run", refused)
    # Text-only on the CPU: no profile, it could not change the size.
    assert _core("qwen2", kv_cache_bytes=4 * MiB).kv_cache_blocks == 1 + 512
    # Capped at what every sequence at full length needs: 2 x 256 blocks.
    assert _core("qwen2", max_num_seqs=2).kv_cache_blocks == 1 + 512
    # An explicit block count skips sizing altogether.
    monkeypatch.setattr(worker_module, "kv_cache_budget", refused)
    assert _core("qwen2_vl", kv_cache_blocks=12).kv_cache_blocks == 12


def test_profiling_imports_no_frontend():
    tree = ast.parse((ROOT / "atb_plugin/engine/memory_profile.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [n for n in names if n.startswith(("input_builders", "routers", "shm", "atb_plugin.server"))], names


def test_an_explicit_kv_cache_memory_wins_on_a_device(simulated_device, monkeypatch):
    def refused(*args):
        raise AssertionError("an explicit budget needs no profile for a text model")

    monkeypatch.setattr(memory_profile, "profile_run", refused)
    assert _core("qwen2", kv_cache_bytes=4 * MiB, max_num_seqs=512).kv_cache_blocks == 1 + 4 * MiB // 8192


def test_the_offline_llm_enforces_the_users_image_limit(images):
    from atb_plugin import LLM
    from input_builders.media_config import MediaConfig

    media = MediaConfig(allowed_local_media_paths=(str(images[0].parent),))
    with LLM(tiny_checkpoint("qwen2_vl"), limit_mm_per_prompt=1, media_config=media) as llm:
        content = [{"image": str(images[0])}, {"image": str(images[1])}, {"text": "compare"}]
        with pytest.raises(ValueError, match=r"at most 1 per prompt"):
            llm.chat([{"role": "user", "content": content}])
