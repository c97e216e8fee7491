"""One frontend for both doors: the same request gives the same answer through the offline ``LLM``
and the HTTP server (text, seeded sampling with the checkpoint's generation_config defaults,
logprobs, n > 1, an image chat, a pooling request), and the house's floors hold (no import runs
upward, the engine core knows no frontend, the server sees the engine only through its client,
config and messages).

Equality is exact: both doors run the same input processor, the same CPU kernels on one request
at a time, and the same sampler with the same per-request seeded generator; JSON carries
Python floats losslessly."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.testing.tiny import tiny_checkpoint
from tests.server_helpers import ServerProcess, data_url

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def text_server(serve):
    with serve(tiny_checkpoint("qwen2"), "--max-model-len", "128") as server:
        yield server


@pytest.fixture(scope="module")
def text_llm():
    with LLM(tiny_checkpoint("qwen2"), block_size=16, max_model_len=128) as llm:
        yield llm


def seeded(llm: LLM, **fields) -> SamplingParams:
    """What a request setting only ``fields`` samples with: the checkpoint's defaults for the rest."""
    return dataclasses.replace(llm.get_default_sampling_params(), **fields)


def test_the_offline_defaults_are_the_checkpoints_generation_config(text_llm):
    # tiny qwen2's generation_config.json: temperature 0.7, top_k 20, top_p 0.8, repetition_penalty 1.05
    assert text_llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_p=0.8, top_k=20,
                                                                    repetition_penalty=1.05)


@pytest.mark.slow  # a real server
def test_a_seeded_completion_with_logprobs_is_the_same_through_both_doors(text_server, text_llm):
    answer = text_server.client().completions.create(model=str(tiny_checkpoint("qwen2")), prompt=PROMPT,
                                                     max_tokens=12, seed=7, logprobs=2)
    offline = text_llm.generate(PROMPT, seeded(text_llm, max_tokens=12, seed=7, logprobs=2))[0]
    choice, completion = answer.choices[0], offline.outputs[0]
    assert choice.text == completion.text
    assert choice.finish_reason == completion.finish_reason
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert answer.usage.completion_tokens == len(completion.token_ids)
    assert choice.logprobs.token_logprobs == [entry.logprob for entry in completion.logprobs]


@pytest.mark.slow  # a real server
def test_a_seeded_chat_with_n_choices_is_the_same_through_both_doors(text_server, text_llm):
    answer = text_server.client().chat.completions.create(model=str(tiny_checkpoint("qwen2")), messages=CHAT,
                                                          max_tokens=10, seed=11, n=3)
    offline = text_llm.chat(CHAT, seeded(text_llm, max_tokens=10, seed=11, n=3))[0]
    assert [c.message.content for c in answer.choices] == [o.text for o in offline.outputs]
    assert [c.finish_reason for c in answer.choices] == [o.finish_reason for o in offline.outputs]
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)


@pytest.mark.slow  # a real server
def test_an_unset_max_tokens_is_the_same_through_both_doors(text_server, text_llm):
    # Neither door caps a chat without max_tokens below the context window: both run to EOS or
    # to max_model_len, with the same seeded tokens.
    answer = text_server.client().chat.completions.create(model=str(tiny_checkpoint("qwen2")), messages=CHAT,
                                                          seed=3, temperature=0)
    offline = text_llm.chat(CHAT, seeded(text_llm, max_tokens=None, seed=3, temperature=0.0))[0]
    assert answer.choices[0].message.content == offline.outputs[0].text
    assert answer.choices[0].finish_reason == offline.outputs[0].finish_reason


@pytest.mark.slow  # a real server
def test_the_same_bad_request_is_refused_through_both_doors(text_server, text_llm):
    too_long = [1] * 200
    response = text_server.post("/v1/completions", {"prompt": too_long, "max_tokens": 4})
    assert response.status_code == 400
    with pytest.raises(ValueError) as offline:
        text_llm.generate(too_long, SamplingParams(max_tokens=4))
    assert response.json()["error"]["message"] == str(offline.value)
    response = text_server.post("/v1/completions", {"prompt": [10 ** 6], "max_tokens": 4})
    with pytest.raises(ValueError) as offline:
        text_llm.generate([10 ** 6], SamplingParams(max_tokens=4))
    assert response.status_code == 400 and response.json()["error"]["message"] == str(offline.value)


@pytest.mark.slow  # a real server
def test_without_a_served_model_name_the_public_name_is_the_checkpoints_not_its_path(text_server):
    """The server's public name defaults to the checkpoint directory's name (the server is
    started without --served-model-name); the path is still accepted as `model`, and neither
    /v1/models nor an error message shows it."""
    path = tiny_checkpoint("qwen2")
    name = path.name
    models = text_server.get("/v1/models")
    card = models.json()["data"][0]
    assert card["id"] == name and card["root"] == name
    assert str(path) not in models.text and str(path.parent) not in models.text
    for model in (name, str(path), None):
        answer = text_server.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == name, answer.text
    wrong = text_server.post("/v1/completions", {"model": "gpt-4", "prompt": PROMPT})
    assert wrong.status_code == 404 and f"This server serves `{name}`." in wrong.json()["error"]["message"]
    pooled = text_server.post("/v1/embeddings", {"input": "hi"})  # the engine's message names the model
    assert pooled.status_code == 400 and f"{name} is a generative model" in pooled.json()["error"]["message"]
    for answer in (wrong, pooled):
        assert str(path.parent) not in answer.text, answer.text


@pytest.mark.server
def test_an_image_chat_is_the_same_through_both_doors():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=5)}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    server = ServerProcess(tiny_checkpoint("qwen2_vl"))
    try:
        answer = server.client().chat.completions.create(model=str(tiny_checkpoint("qwen2_vl")), messages=messages,
                                                         max_tokens=6, seed=2, temperature=0.9, top_p=1.0,
                                                         extra_body={"top_k": 0})
    finally:
        assert server.stop() == 0, server.log()
    with LLM(tiny_checkpoint("qwen2_vl"), block_size=16) as llm:
        offline = llm.chat(messages, seeded(llm, max_tokens=6, seed=2, temperature=0.9, top_p=1.0, top_k=0))[0]
    assert answer.choices[0].message.content == offline.outputs[0].text
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)


@pytest.mark.server
def test_a_pooling_request_is_the_same_through_both_doors():
    texts = ["a fox jumps over the lazy dog"]
    server = ServerProcess(tiny_checkpoint("bert"))
    try:
        answer = server.client().embeddings.create(model=str(tiny_checkpoint("bert")), input=texts)
    finally:
        assert server.stop() == 0, server.log()
    with LLM(tiny_checkpoint("bert"), block_size=16) as llm:
        offline = llm.embed(texts)
    for item, reference in zip(answer.data, offline):
        np.testing.assert_array_equal(np.asarray(item.embedding, dtype=np.float32),
                                      np.asarray(reference.outputs.embedding, dtype=np.float32))
    assert answer.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline)


# -- the house: floors, rooms, the engine's boundary -------------------------------------------------

# Bottom to top; a module may import its own room and rooms on lower floors only.
FLOORS = {
    "shm": 0, "atb_plugin.utils": 0, "atb_plugin.validation": 0, "atb_plugin.processes": 0,
    "atb_plugin.platform": 1, "atb_plugin.distributed": 1, "atb_plugin.ops": 2, "atb_plugin.testing": 3,
    "atb_plugin.pooling": 3, "atb_plugin.multimodal": 3, "atb_plugin.models": 4, "atb_plugin.lora": 4.5,
    "atb_plugin.engine": 5, "input_builders": 5, "routers": 6, "atb_plugin.default_model": 6,
    "atb_plugin.frontend": 7, "atb_plugin.server": 8, "atb_plugin": 9,
}
# The platform picks its op kernels (atb_plugin/ops/*_kernels.py) lazily, at run time: the one
# import that runs upward.
UPWARD_ALLOWED = {("atb_plugin.platform", "atb_plugin.ops")}
# What the HTTP layer may take from the engine: the clients' types (one engine core or several:
# the data-parallel routing names), the config and the messages.
SERVER_ENGINE_MODULES = {"atb_plugin.engine.client", "atb_plugin.engine.dp_client", "atb_plugin.engine.config",
                         "atb_plugin.engine.messages", "atb_plugin.engine.sampling_params"}


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "atb_plugin" and len(parts) > 1 else parts[0]


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports():
    """(importing module's room, imported module, path) for every absolute import in the packages."""
    for package in ("atb_plugin", "routers", "input_builders", "shm"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_of(path)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    # "from atb_plugin import ops" imports atb_plugin.ops
                    names = [f"{node.module}.{a.name}" if node.module == "atb_plugin" else node.module
                             for a in node.names]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in ("atb_plugin", "routers", "input_builders", "shm"):
                        yield _room(module), name, path.relative_to(ROOT)


def test_no_import_runs_up_a_floor_and_no_room_is_missing():
    upward = []
    for room, name, path in _imports():
        target = _room(name)
        assert room in FLOORS and target in FLOORS, f"{path}: a room without a floor ({room} -> {target})"
        if target != room and FLOORS[target] >= FLOORS[room] and (room, target) not in UPWARD_ALLOWED:
            upward.append(f"{path}: {room} (floor {FLOORS[room]}) imports {name} (floor {FLOORS[target]})")
    assert not upward, "\n".join(upward)


def test_the_engine_knows_no_frontend_and_the_server_only_the_engines_surface():
    for room, name, path in _imports():
        if room == "atb_plugin.engine":
            assert not name.startswith(("routers", "input_builders", "shm.store", "atb_plugin.frontend",
                                        "atb_plugin.server")), f"{path} imports {name}"
            assert not name.endswith("ShmStore"), f"{path} imports {name}"
        if room == "atb_plugin.server" and name.startswith("atb_plugin.engine"):
            assert name in SERVER_ENGINE_MODULES, f"{path} imports {name}: use the frontend"


def test_one_place_builds_engine_core_requests():
    callers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "atb_plugin").rglob("*.py")
                     if "EngineCoreRequest(" in path.read_text(encoding="utf-8"))
    assert callers == ["atb_plugin/frontend/input_processor.py"], callers


# -- no circle between files ------------------------------------------------------------------------

def _file_imports(path: Path, modules: set[str]):
    """The atb_plugin modules one file imports, at any depth (a function-level import counts: it is
    the same dependency, only deferred), relative imports resolved."""
    module = _module_of(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            # "from atb_plugin.ops import cpu_native" imports the submodule, "from x import name" x itself
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                          for alias in node.names]
        else:
            continue
        for name in candidates:
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                yield ".".join(parts)


def test_no_import_circle_between_files():
    """Imports flow one way between files too, not only between rooms: a circle (even one hidden in
    a function) means neither file can be read, tested or replaced without the other."""
    paths = {_module_of(p): p for p in (ROOT / "atb_plugin").rglob("*.py")
             if "testing" not in p.relative_to(ROOT).parts}
    modules = set(paths)
    graph = {m: set(_file_imports(p, modules)) & modules for m, p in paths.items()}
    circles, state = [], {}  # state: "open" while on the current path, "done" once fully walked

    def walk(path):
        state[path[-1]] = "open"
        for target in sorted(graph[path[-1]]):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                walk(path + [target])
        state[path[-1]] = "done"

    for module in sorted(graph):
        if module not in state:
            walk([module])
    assert not circles, "import circles between files:\n" + "\n".join(circles)
