"""The engine-core boundary: EngineCore runs from an EngineConfig and token ids alone; the import
direction holds; EngineConfig validation; LLM cleans up after an interrupted call; a seeded
request's tokens do not depend on preemption."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.engine.config import EngineConfig
from atb_plugin.engine.core import EngineCore
from atb_plugin.engine.messages import (EngineCoreOutputs, EngineCoreRequest, SchedulerStats, decode_outputs,
                                        decode_request, encode)
from atb_plugin.testing.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_engine_core_runs_from_a_config_and_token_ids_alone():
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64))
    core.add_request(EngineCoreRequest("a", [5, 6, 7, 8, 9], GREEDY))
    core.add_request(EngineCoreRequest("b", [10, 11, 12], SamplingParams(temperature=0, max_tokens=3)))
    tokens, reasons = {"a": [], "b": []}, {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert len(tokens["a"]) == 8 and len(tokens["b"]) == 3
    assert reasons == {"a": "length", "b": "length"}
    assert core.kv_cache_manager.num_free_blocks == 63
    # The same ids through LLM give the same tokens.
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        assert llm.generate([5, 6, 7, 8, 9], GREEDY)[0].outputs[0].token_ids == tokens["a"]


def test_engine_core_stats_and_abort():
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64))
    core.add_request(EngineCoreRequest("a", list(range(5, 25)), GREEDY))
    core.step()
    stats = core.make_stats()
    assert stats.num_running == 1 and stats.prefix_cache_queries == 20 and 0 < stats.kv_cache_usage < 1
    core.abort(["a", "unknown"])
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == 63


def test_engine_core_refuses_handles_of_unregistered_instances(store, images):
    import numpy as np

    handle = store.put(np.zeros((1, 3, 8, 8), np.float32), key="k", request_id="r")
    ids = [1, handle.name_value, handle.shape_value, 2]
    core = EngineCore(EngineConfig(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=64))
    core.add_request(EngineCoreRequest("r", ids, GREEDY, shm_instances=(store.instance_id,)))
    outs = core.step()
    # A text model takes no images: the request fails alone with a message.
    assert outs[0].finish_reason == "error" and "takes no images" in outs[0].error
    store.release("r")


def test_messages_round_trip_through_msgpack():
    request = EngineCoreRequest("r1", [1, 2, -3], SamplingParams(temperature=0.5, seed=3, stop=["x"]),
                                eos_token_ids=(2,), shm_instances=("ab12",))
    assert decode_request(encode(request)) == request
    outputs = EngineCoreOutputs([], SchedulerStats(1, 2, 0.25, 10, 4, 0))
    assert decode_outputs(encode(outputs)) == outputs


@pytest.mark.parametrize("field, value, words", [
    ("dtype", "float64", "float32"),
    ("device", "tpu", "npu"),
    ("block_size", 0, "block_size = 0"),
    ("max_num_seqs", 2.5, "integer"),
    ("max_model_len", 10 ** 9, "max_model_len"),
    ("kv_cache_blocks", 1, "kv_cache_blocks"),
    ("enable_prefix_caching", "yes", "bool"),
])
def test_engine_config_names_the_bad_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(tiny_checkpoint("qwen2"), **{field: value})


def test_engine_config_reads_the_checkpoint_and_prints_one_line_per_field(tmp_path):
    config = EngineConfig(tiny_checkpoint("qwen2"))
    assert config.vocab_size > 0 and config.max_model_len > 0 and config.model_type == "qwen2"
    assert config.scheduler_config.max_model_len == config.max_model_len
    lines = config.describe().splitlines()
    assert any(line.startswith("block_size = 16") for line in lines) and len(lines) >= 12
    with pytest.raises(ValueError, match="config.json does not exist"):
        EngineConfig(str(tmp_path))
    with pytest.raises(ValueError, match="unknown argument"):
        LLM(tiny_checkpoint("qwen2"), kv_blocks=3)


def test_an_interrupted_generate_leaves_nothing_behind():
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        engine = llm.engine
        real_step, calls = engine.step, [0]

        def interrupted_step():
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            return real_step()

        engine.step = interrupted_step
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["hello world", "the cat sat"], GREEDY)
        engine.step = real_step
        assert not engine.has_unfinished_requests()
        assert not engine.output_processor.has_unfinished_requests()
        outputs = llm.generate(["a"], GREEDY)
        assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 8


def test_seeded_sampling_survives_preemption():
    prompts = ["hello world", "the cat sat on the mat and then", "a", "numbers: 1 2 3 4 5 6 7 8 9 10 11 12"]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i, max_tokens=48, ignore_eos=True)
              for i in range(4)]
    with LLM(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=256) as llm:
        roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(tiny_checkpoint("qwen2"), block_size=4, kv_cache_blocks=24) as llm:
        tight = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_preemptions >= 2
    assert tight == roomy


@pytest.mark.parametrize("prompt", [None, 3, [], [-1, 5], [1, 10 ** 9], [1.5], "x" and [{"bogus": 1}]])
def test_bad_prompts_are_value_errors(prompt):
    with LLM(tiny_checkpoint("qwen2"), block_size=4) as llm:
        with pytest.raises(ValueError):
            llm.generate(prompt, GREEDY)
        assert not llm.engine.has_unfinished_requests()


CORE_MODULES = ["atb_plugin/engine/" + name for name in (
    "core.py", "config.py", "scheduler.py", "kv_cache_manager.py", "block_pool.py", "model_runner.py",
    "input_batch.py", "prepare_inputs.py", "sampler.py", "request.py", "messages.py", "sampling_params.py",
    "memory_profile.py")]


def test_the_engine_core_imports_no_frontend():
    # Statically: no module the core runs names the builders, the routers or the store.
    forbidden = ("input_builders", "routers", "shm.store", "atb_plugin.server", "atb_plugin.frontend",
                 "transformers")
    for path in CORE_MODULES + ["atb_plugin/multimodal/prompt.py"]:
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                assert not name.startswith(forbidden), f"{path} imports {name}"
                assert not name.endswith("ShmStore"), f"{path} imports {name}"
    # Dynamically: importing the core loads neither the builders nor the routers.
    code = ("import sys, atb_plugin.engine.core; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('input_builders', 'routers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_comment_points_outside_the_repo():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or path.name == Path(__file__).name:
            continue
        text = path.read_text(encoding="utf-8")
        for marker in ("../shared", "seeds/", "DESIGN §", "DESIGN.md"):
            if marker in text:
                offenders.append(f"{path.relative_to(ROOT)}: {marker}")
    assert not offenders, offenders


def test_a_handle_of_an_unregistered_instance_fails_only_its_request(tmp_path):
    from input_builders.media_config import MediaConfig
    from tests.helpers import write_test_images

    images = write_test_images(tmp_path, sizes=((60, 90),))
    chat = [{"role": "user", "content": [{"image": str(images[0])}, {"text": "hi"}]}]
    with LLM(tiny_checkpoint("qwen2_vl"), block_size=16,
             media_config=MediaConfig(allowed_local_media_paths=(str(tmp_path),))) as llm:
        engine = llm.engine
        ids = llm.router.input_builder.make_context(0, chat, request_id="forged")
        core = engine.core
        # Registered for another instance: the core must not read this segment.
        core.add_request(EngineCoreRequest("forged", ids, GREEDY, shm_instances=("zzzz",)))
        core.add_request(EngineCoreRequest("honest", ids, GREEDY, shm_instances=(engine.shm_store.instance_id,)))
        ends = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    ends[out.request_id] = out
        engine.shm_store.release("forged")
    assert ends["forged"].finish_reason == "error" and "belongs to instance" in ends["forged"].error
    assert ends["honest"].finish_reason == "length"
