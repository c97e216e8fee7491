"""The platform picks a legal engine configuration at start-up: dtype ``auto`` and the default KV
block size per platform (and per Ascend chip), the op rules for explicit values, unsupported chips,
a missing ATB library, and which NPU kernel set runs. The NPU is the simulated one
(``fake_torch_npu``) with its chip name patched."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

from atb_plugin.engine.config import EngineConfig, head_size
from atb_plugin.platform import PLATFORMS, current_platform, reset_current_platform, use_platform
from atb_plugin.platform import npu as npu_platform
from atb_plugin.platform.cuda import CudaPlatform
from atb_plugin.platform.npu import KERNEL_SET_OPS, KERNEL_SETS, KERNELS_ENV
from atb_plugin.server import cli
from atb_plugin.testing import fake_torch_npu
from atb_plugin.testing.tiny import tiny_checkpoint

A2, A3, B310, P310 = "Ascend910B4", "Ascend910_9392", "Ascend310B1", "Ascend310P3"
FP32_FIX = "use --dtype bfloat16 or float16 (the ATB attention ops take fp16/bf16 only)"


@pytest.fixture
def model(tmp_path):
    """A checkpoint directory holding only the tiny qwen2 config.json (head size 16)."""
    shutil.copy(tiny_checkpoint("qwen2") / "config.json", tmp_path / "config.json")
    return tmp_path


def with_head_size(model_dir, head: int):
    config = json.loads((model_dir / "config.json").read_text())
    config["head_dim"] = head
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.delenv("ATB_PLUGIN_DEVICE", raising=False)
    reset_current_platform()
    with use_platform("cpu"):
        yield
    reset_current_platform()


@pytest.fixture
def npu(monkeypatch):
    """The simulated NPU as the current platform, the ATB kernel set selected; call the fixture's
    value with a chip name to make ``torch_npu.npu.get_device_name()`` answer it."""
    monkeypatch.delenv("ATB_PLUGIN_DEVICE", raising=False)
    monkeypatch.setenv(KERNELS_ENV, "atb")
    reset_current_platform()
    handle = fake_torch_npu.install()

    def set_chip(name: str):
        monkeypatch.setattr(handle.module.npu, "get_device_name", lambda device=None: name)
        return handle

    set_chip(A2)
    try:
        with use_platform("npu"):
            yield set_chip
    finally:
        handle.uninstall()
        reset_current_platform()


# --------------------------------------------------------------------------------------------
# CPU / CUDA: unchanged behaviour
# --------------------------------------------------------------------------------------------


def test_cpu_defaults_float32_and_block_16(cpu, model):
    config = EngineConfig(model)
    assert (config.dtype, config.block_size) == ("float32", 16)
    assert "dtype = 'float32'" in config.describe() and "block_size = 16" in config.describe()
    explicit = EngineConfig(model, device="cpu")
    assert (explicit.dtype, explicit.block_size) == ("float32", 16)


@pytest.mark.parametrize("block_size", [1, 4, 48, 256, 1024])
def test_cpu_runs_any_block_size(cpu, model, block_size):
    assert EngineConfig(model, block_size=block_size).block_size == block_size


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cpu_keeps_an_explicit_dtype(cpu, model, dtype):
    assert EngineConfig(model, dtype=dtype).dtype == dtype


def test_replace_keeps_the_resolved_values(cpu, model):
    config = EngineConfig(model)
    assert config.replace(max_num_seqs=3).block_size == 16


def test_cpu_config_never_asks_for_torch_npu(monkeypatch, model):
    def boom():
        raise AssertionError("torch_npu probed for a CPU config")

    monkeypatch.setattr(npu_platform, "unavailable_reason", boom)
    assert EngineConfig(model, device="cpu").dtype == "float32"
    assert "torch_npu" not in sys.modules


def test_named_device_that_is_missing_fails_at_start_up(monkeypatch, model):
    monkeypatch.delenv("ATB_PLUGIN_DEVICE", raising=False)
    if PLATFORMS["npu"].is_available():
        pytest.skip("an NPU is present")
    with pytest.raises(RuntimeError, match="platform 'npu' .* not available"):
        EngineConfig(model, device="npu")


@pytest.mark.parametrize("bf16, expected", [(True, "bfloat16"), (False, "float16")])
def test_cuda_auto_dtype(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    platform = CudaPlatform()
    assert platform.resolve_dtype("auto") == expected
    assert platform.default_block_size() == 16
    assert platform.resolve_dtype("float32") == "float32"


def test_head_size_from_config_json():
    assert head_size({"hidden_size": 64, "num_attention_heads": 4}) == 16
    assert head_size({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128}) == 128
    assert head_size({"head_dim": None, "hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert head_size({"model_type": "llava", "text_config": {"hidden_size": 2048, "num_attention_heads": 16}}) == 128
    assert head_size({"model_type": "x"}) is None


# --------------------------------------------------------------------------------------------
# NPU: dtype
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chip, expected", [(A2, "bfloat16"), (A3, "bfloat16"), (B310, "float16"),
                                            ("Ascend910A", "float16")])
def test_npu_auto_dtype_per_chip(npu, model, chip, expected):
    npu(chip)
    config = EngineConfig(model)
    assert config.dtype == expected
    assert f"dtype = {expected!r}" in config.describe()


@pytest.mark.parametrize("chip", [A2, B310])
def test_npu_refuses_float32_naming_the_fix(npu, model, chip):
    npu(chip)
    with pytest.raises(ValueError) as error:
        EngineConfig(model, dtype="float32")
    assert "EngineConfig.dtype = 'float32'" in str(error.value) and FP32_FIX in str(error.value)


def test_npu_explicit_half_dtypes(npu, model):
    assert EngineConfig(model, dtype="float16").dtype == "float16"
    assert EngineConfig(model, dtype="bfloat16").dtype == "bfloat16"
    npu(B310)
    assert EngineConfig(model, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match=r"Ascend310B1 has no bfloat16 .*: use --dtype float16"):
        EngineConfig(model, dtype="bfloat16")


# --------------------------------------------------------------------------------------------
# NPU: block size
# --------------------------------------------------------------------------------------------


def test_npu_default_block_size_is_128(npu, model):
    config = EngineConfig(model)
    assert config.block_size == 128
    assert "block_size = 128" in config.describe()


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_npu_accepts_multiples_of_16_up_to_128(npu, model, block_size):
    assert EngineConfig(model, block_size=block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [4, 8, 24, 40, 49, 100, 144, 256])
def test_npu_refuses_illegal_block_sizes_at_start_up(npu, model, block_size):
    with pytest.raises(ValueError) as error:
        EngineConfig(model, block_size=block_size)
    message = str(error.value)
    assert f"EngineConfig.block_size = {block_size}" in message
    assert "multiple of 16 in [16, 128]" in message


def test_npu_block_size_48_is_legal_but_256_is_not(npu, model):
    assert EngineConfig(model, block_size=48).block_size == 48
    with pytest.raises(ValueError, match=r"block_size = 256: .*multiple of 16 in \[16, 128\]"):
        EngineConfig(model, block_size=256)


def test_npu_splitfuse_rule_limits_block_size_by_head_size(npu, model):
    with_head_size(model, 256)  # ATB split-fuse: block_size * head_size <= 128 * 128
    config = EngineConfig(model)
    assert config.block_size == 64  # the largest legal one is the default
    assert EngineConfig(model, block_size=64).block_size == 64
    with pytest.raises(ValueError) as error:
        EngineConfig(model, block_size=128)
    message = str(error.value)
    assert "EngineConfig.block_size = 128" in message and "[16, 64]" in message
    assert "block_size * head_size <= 16384" in message and "head_size is 256" in message


def test_npu_splitfuse_rule_applies_to_the_atb_set_only(npu, monkeypatch):
    platform = PLATFORMS["npu"]
    with pytest.raises(ValueError, match="block_size \\* head_size"):
        platform.check_block_size(128, 256)
    monkeypatch.setenv(KERNELS_ENV, "fia")
    platform.check_block_size(128, 256)
    assert platform.default_block_size(256) == platform.default_block_size() == 128


@pytest.mark.parametrize("block_size, legal", [(128, True), (256, True), (512, True), (16, False), (64, False),
                                               (192, False), (640, False)])
def test_npu_fia_set_block_sizes(npu, monkeypatch, block_size, legal):
    """npu_fused_infer_attention_score's page attention (prefill): multiples of 128 in [128, 512]."""
    monkeypatch.setenv(KERNELS_ENV, "fia")
    platform = PLATFORMS["npu"]
    if legal:
        platform.check_block_size(block_size, 128)
    else:
        with pytest.raises(ValueError, match=rf"block_size = {block_size}: .*multiple of 128 in \[128, 512\]"):
            platform.check_block_size(block_size, 128)


# --------------------------------------------------------------------------------------------
# NPU: unsupported chips, missing libraries
# --------------------------------------------------------------------------------------------


def test_310p_is_refused_at_start_up(npu, model):
    npu(P310)
    for kwargs in ({}, {"dtype": "float16", "block_size": 128}):
        with pytest.raises(RuntimeError, match="Ascend310P3 .*not supported yet: .*NZ"):
            EngineConfig(model, **kwargs)


@pytest.mark.parametrize("op", ["_npu_paged_attention", "_npu_reshape_and_cache", "_npu_paged_attention_splitfuse"])
def test_missing_atb_op_is_a_clear_start_up_error(npu, model, monkeypatch, op):
    monkeypatch.delattr(npu(A2).module, op)
    with pytest.raises(RuntimeError) as error:
        EngineConfig(model)
    message = str(error.value)
    assert f"lacks {op}" in message and "'atb' NPU kernel set" in message
    assert "ATB library (the NNAL package)" in message and "set_env.sh" in message


def test_missing_fia_op_names_the_alternative(npu, monkeypatch):
    module = npu(A2).module
    monkeypatch.delattr(module, "npu_fused_infer_attention_score", raising=False)
    reason = npu_platform.missing_ops_reason(module, KERNEL_SET_OPS["fia"], "fia")
    assert "lacks" in reason and "npu_fused_infer_attention_score" in reason
    assert f"{KERNELS_ENV}=atb" in reason


def test_fia_set_end_to_end_config_on_a2(npu, model, monkeypatch):
    monkeypatch.delenv(KERNELS_ENV)
    module = npu(A2).module
    for op in KERNEL_SET_OPS["fia"]:  # only the start-up check runs here, no op is called
        if not hasattr(module, op):
            monkeypatch.setattr(module, op, lambda *a, **k: None, raising=False)
    config = EngineConfig(model)
    assert (config.dtype, config.block_size) == ("bfloat16", 128)
    with pytest.raises(ValueError, match="EngineConfig.block_size = 64: .*multiple of 128"):
        EngineConfig(model, block_size=64)


def test_atb_library_that_does_not_load_is_a_clear_error(monkeypatch):
    """A real torch_npu (no FAKE_DEVICE) whose ATB ops exist as lazy wrappers but whose
    libop_plugin_atb.so cannot load libatb.so (NNAL not sourced)."""
    real_like = types.ModuleType("torch_npu")
    real_like.__version__ = "2.5.1"
    for op in KERNEL_SET_OPS["atb"]:
        setattr(real_like, op, lambda *a, **k: None)

    def fail():
        raise OSError("libatb.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(npu_platform, "_load_atb_library", fail)
    reason = npu_platform.missing_ops_reason(real_like, KERNEL_SET_OPS["atb"], "atb")
    assert "cannot load the ATB op library" in reason and "libatb.so" in reason
    assert "NNAL" in reason and "source /usr/local/Ascend/nnal/atb/set_env.sh" in reason
    # a kernel set that calls no ATB op does not need the library
    assert npu_platform.missing_ops_reason(real_like, ("npu_rms_norm",), "fia") is None
    monkeypatch.setattr(npu_platform, "_load_atb_library", lambda: None)
    assert npu_platform.missing_ops_reason(real_like, KERNEL_SET_OPS["atb"], "atb") is None


def test_simulated_npu_passes_the_library_check(npu):
    assert npu_platform.missing_ops_reason(sys.modules["torch_npu"], KERNEL_SET_OPS["atb"], "atb") is None


# --------------------------------------------------------------------------------------------
# NPU: kernel sets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chip, expected", [(A2, "fia"), (A3, "fia"), ("Ascend910B2C", "fia"), (B310, "atb"),
                                            ("Ascend910A", "atb"), ("fake Ascend NPU (simulated on CPU)", "atb")])
def test_default_kernel_set_per_chip(npu, monkeypatch, chip, expected):
    monkeypatch.delenv(KERNELS_ENV)
    npu(chip)
    platform = current_platform()
    assert platform.kernel_set() == expected
    assert platform.kernels_module_name() == KERNEL_SETS[expected]


@pytest.mark.parametrize("chosen", ["atb", "fia", " FIA "])
def test_kernel_set_from_the_environment(npu, monkeypatch, chosen):
    for chip in (A2, B310):
        npu(chip)
        monkeypatch.setenv(KERNELS_ENV, chosen)
        assert current_platform().kernels_module_name() == KERNEL_SETS[chosen.strip().lower()]


def test_atb_kernel_set_is_the_ops_module(npu):
    assert current_platform().kernels.__name__ == "atb_plugin.ops.npu_kernels"


def test_kernel_selection_follows_env_and_chip_changes(npu, monkeypatch):
    platform = current_platform()
    assert platform.kernels_module_name() == KERNEL_SETS["atb"]
    monkeypatch.setenv(KERNELS_ENV, "fia")
    assert platform.kernels_module_name() == KERNEL_SETS["fia"]
    monkeypatch.delenv(KERNELS_ENV)
    npu(B310)
    assert platform.kernels_module_name() == KERNEL_SETS["atb"]
    npu(A3)
    assert platform.kernels_module_name() == KERNEL_SETS["fia"]


def test_invalid_kernel_set_is_a_clear_error(npu, model, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "xla")
    with pytest.raises(ValueError, match=f"{KERNELS_ENV}='xla': expected one of atb, fia"):
        current_platform().kernel_set()
    with pytest.raises(ValueError, match=KERNELS_ENV):
        EngineConfig(model)


# --------------------------------------------------------------------------------------------
# the server's flags
# --------------------------------------------------------------------------------------------


def test_cli_defaults_are_the_platforms(cpu, model):
    args = cli.build_parser().parse_args([])
    assert (args.dtype, args.block_size) == ("auto", None)
    engine = cli.parse_config(["--model", str(model)]).engine
    assert (engine.dtype, engine.block_size) == ("float32", 16)


def test_cli_on_npu(npu, model, capsys):
    engine = cli.parse_config(["--model", str(model)]).engine
    assert (engine.dtype, engine.block_size) == ("bfloat16", 128)
    assert cli.main(["serve", "--model", str(model), "--dtype", "float32"]) == 2
    assert FP32_FIX in capsys.readouterr().err
    assert cli.main(["--model", str(model), "--block-size", "256"]) == 2
    assert "EngineConfig.block_size = 256" in capsys.readouterr().err
    npu(P310)
    assert cli.main(["--model", str(model)]) == 2
    assert "Ascend310P3" in capsys.readouterr().err
