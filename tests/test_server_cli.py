"""The service's command line: every flag the issue names is documented in --help, a MindIE
config.json fills the flags it maps to (a flag on the command line wins), bad values are refused
with the flag's name."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from atb_plugin.server.cli import parse_config
from atb_plugin.server.config import default_served_model_name
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import REPO_ROOT
from tests.test_mindie_config import SAMPLE

FLAGS = ["--model", "--served-model-name", "--host", "--port", "--device", "--dtype", "--max-model-len",
         "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--kv-cache-memory",
         "--enable-prefix-caching", "--limit-mm-per-prompt", "--mm-wire-dtype", "--num-threads", "--enforce-eager",
         "--allowed-local-media-path",
         "--allowed-media-domains", "--max-image-bytes", "--max-image-pixels", "--max-request-pixels",
         "--max-request-body-bytes", "--max-audio-bytes", "--max-audio-seconds",
         "--max-queued-requests", "--chat-template", "--api-key", "--tokenizer-workers", "--shm-budget-bytes",
         "--shutdown-timeout", "--config"]


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "atb_plugin.server", "--help"], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in FLAGS:
        assert flag in out.stdout, flag


def test_a_mindie_config_fills_the_flags_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    config = copy.deepcopy(SAMPLE)
    model = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    model["modelWeightPath"] = str(tiny_checkpoint("qwen2"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    server = parse_config(["--config", str(path), "--port", "9999", "--block-size=32"])
    assert server.port == 9999 and server.engine.block_size == 32  # given flags win (both spellings)
    assert server.host == "192.168.0.24" and server.served_model_name == "qwen2-vl"
    assert server.engine.model == str(tiny_checkpoint("qwen2")) and server.engine.max_model_len == 2560
    assert server.max_input_tokens == 2048 and server.tokenizer_workers == 8
    assert server.engine.max_num_seqs == 200
    import os

    assert os.environ["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port"),
    (["--num-threads", "0"], "num_threads"),
    (["--tokenizer-workers", "0"], "--tokenizer-workers"),
    (["--max-model-len", "100000000"], "max_model_len"),
    (["--shm-budget-bytes", "-1"], "--shm-budget-bytes"),
    (["--max-request-pixels", "0"], "--max-request-pixels"),
])
def test_bad_values_name_the_flag(argv, words):
    with pytest.raises(ValueError, match=words):
        parse_config(["--model", str(tiny_checkpoint("qwen2"))] + argv)


def test_the_request_pixel_budget_defaults_to_four_images_and_reaches_the_media_config():
    model = ["--model", str(tiny_checkpoint("qwen2_vl"))]
    default = parse_config(model)
    assert default.max_request_pixels == 4 * default.max_image_pixels == 144_000_000
    assert "max_request_pixels = 144000000" in default.describe()  # the value in force is logged
    assert parse_config(model + ["--max-image-pixels", "1000"]).media_config().max_request_pixels == 4000
    given = parse_config(model + ["--max-image-pixels", "1000", "--max-request-pixels", "1500"]).media_config()
    assert (given.max_image_pixels, given.max_request_pixels, given.api) == (1000, 1500, "server")


def test_the_default_served_name_is_the_checkpoints_name_not_its_path(tmp_path):
    assert default_served_model_name("/models/Qwen2-VL-7B-Instruct") == "Qwen2-VL-7B-Instruct"
    assert default_served_model_name("/models/Qwen2-VL-7B-Instruct/") == "Qwen2-VL-7B-Instruct"
    snapshot = "/root/.cache/huggingface/hub/models--Qwen--Qwen2-VL-2B-Instruct/snapshots/0123abcd"
    assert default_served_model_name(snapshot) == "Qwen/Qwen2-VL-2B-Instruct"  # the hub's name
    assert default_served_model_name("/data/snapshots/v2") == "v2"  # not a hub cache: the directory's name
    model = tiny_checkpoint("qwen2")
    assert parse_config(["--model", str(model)]).served_model_name == model.name
    assert parse_config(["--model", str(model), "--served-model-name", "mine"]).served_model_name == "mine"


def test_the_default_embedding_model_is_served_under_its_own_name():
    # Its package keeps it in a directory named "model", which would be a poor public name.
    assert parse_config(["--runner", "pooling"]).served_model_name == "all-MiniLM-L6-v2"


def test_the_wire_dtype_flag_reaches_the_engine_config(capsys):
    model = str(tiny_checkpoint("qwen2_vl"))
    assert parse_config(["--model", model]).engine.mm_wire_dtype == "uint8"  # the default
    assert parse_config(["--model", model, "--mm-wire-dtype", "float32"]).engine.mm_wire_dtype == "float32"
    with pytest.raises(SystemExit):
        parse_config(["--model", model, "--mm-wire-dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_the_engine_leaves_the_tokenizer_workers_their_cores_for_image_models(monkeypatch):
    import atb_plugin.server.cli as cli

    monkeypatch.setattr(cli, "available_cores", lambda: 8)
    vl, text = str(tiny_checkpoint("qwen2_vl")), str(tiny_checkpoint("qwen2"))
    assert parse_config(["--model", vl, "--tokenizer-workers", "3"]).engine.num_threads == 5
    assert parse_config(["--model", vl, "--tokenizer-workers", "9"]).engine.num_threads == 1  # at least one
    assert parse_config(["--model", vl, "--limit-mm-per-prompt", "0", "--tokenizer-workers", "3"]).engine.num_threads \
        == parse_config(["--model", text]).engine.num_threads  # no images: every core
    assert parse_config(["--model", vl, "--num-threads", "7"]).engine.num_threads == 7  # given: as given


_CHURN = """
import resource, sys
from atb_plugin.utils import keep_request_buffers_in_heap
if sys.argv[1] == "tuned":
    assert keep_request_buffers_in_heap()
chunk = bytes(range(256))
def churn():  # what a resent image body does: a few megabyte copies made and dropped
    for _ in range(40):
        body = chunk * 16384
        copy = body[1:]
        del body, copy
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_request_buffers_are_reused_not_faulted_in_afresh():
    """keep_request_buffers_in_heap (the API process and the tokenizer workers call it): megabyte
    buffers made and freed over and over stop costing fresh pages (each 4 KiB page faulted in and
    zeroed), which by default is ~1,000 faults per 4 MiB copy."""
    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    default, tuned = faults("default"), faults("tuned")
    assert default > 20_000  # 80 copies of 4 MiB, each in fresh pages
    assert tuned < default // 20


def test_a_bad_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--model", str(tiny_checkpoint("qwen2")), "--kv-cache-memory", "lots"])
    assert "is not a size" in capsys.readouterr().err
