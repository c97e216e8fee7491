"""Multi-LoRA through the service (docs/lora.md): adapters served by name (--lora-modules, both
spellings), listed by /v1/models with their parent, picked by `model`, through the official
``openai`` client; greedy tokens equal the checkpoint with the adapter merged into its weights;
runtime load / unload behind its flag and the allowed directories; unknown names are vLLM's 404;
the flags, vLLM's environment variable and MindIE's LoraModules map onto the config."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from atb_plugin import LLM, SamplingParams
from atb_plugin.server.cli import parse_config
from atb_plugin.server.mindie_config import map_mindie_config
from atb_plugin.testing.lora_adapters import make_adapter, merge_adapter
from atb_plugin.testing.tiny import tiny_checkpoint

PROMPTS = ["hello world", "the quick brown fox jumps"]
MAX_TOKENS = 8
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = tiny_checkpoint("llama")
    made = {"a": make_adapter(root / "a", base, r=8, lora_alpha=16, seed=1),
            "b": make_adapter(root / "b", base, r=4, lora_alpha=8, seed=2, rank_pattern={"o_proj": 2}),
            "c": make_adapter(root / "allowed" / "c", base, r=16, lora_alpha=32, seed=3, use_rslora=True),
            "big": make_adapter(root / "allowed" / "big", base, r=32, seed=4),
            "outside": make_adapter(root / "outside", base, r=4, seed=5)}
    references = {}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("a", "b", "c"):
        with LLM(merge_adapter(root / f"merged-{name}", base, made[name]), block_size=16) as llm:
            references[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    with LLM(base, block_size=16) as llm:
        references[None] = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    return root, made, references


@pytest.fixture(scope="module")
def server(serve, adapters):
    root, made, _ = adapters
    b_json = json.dumps({"name": "b", "path": str(made["b"]), "base_model_name": "llama-family"})
    with serve(tiny_checkpoint("llama"), "--served-model-name", BASE, "--enable-lora", "--max-loras", "2",
               "--max-lora-rank", "16", "--lora-modules", f"a={made['a']}", b_json, "--allow-runtime-lora-updating",
               "--allowed-lora-dir", str(root / "allowed")) as server:
        yield server


def _complete(client, model, prompt, **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True, "repetition_penalty": 1.0, **extra})


def test_models_list_adapters_with_their_parent(server):
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {BASE, "a", "b"}
    assert cards["a"].parent == BASE and cards["b"].parent == "llama-family"
    assert getattr(cards[BASE], "parent", None) is None


def test_each_model_name_runs_its_adapter_even_when_mixed(server, adapters):
    _, _, references = adapters
    client = server.client()
    results, threads = {}, []
    for name in ("a", "b", None):  # concurrently: their rows share steps
        for index, prompt in enumerate(PROMPTS):
            def run(name=name, index=index, prompt=prompt):
                response = _complete(client, name or BASE, prompt)
                results[name, index] = (response.model, response.choices[0].text)
            threads.append(threading.Thread(target=run))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (name, index), (model, text) in results.items():
        assert model == (name or BASE) and text == references[name][index], (name, index)
    assert len(results) == 6
    # Streaming through an adapter gives the same text.
    stream = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == references["a"][0]


def test_unknown_model_is_vllms_404(server):
    with pytest.raises(openai.NotFoundError) as caught:
        _complete(server.client(), "no-such-adapter", PROMPTS[0])
    error = caught.value.body if "error" not in (caught.value.body or {}) else caught.value.body["error"]
    assert error["code"] == 404 and error["type"] == "NotFoundError" and "no-such-adapter" in error["message"]


def test_runtime_load_and_unload(server, adapters):
    root, made, references = adapters
    load = server.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(made["c"])})
    assert load.status_code == 200, load.text
    client = server.client()
    assert "c" in {m.id for m in client.models.list().data}
    assert _complete(client, "c", PROMPTS[1]).choices[0].text == references["c"][1]
    again = server.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(made["c"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    refused = {
        "outside": ("outside the allowed directories", made["outside"]),
        "big": ("above max_lora_rank 16", made["big"]),
        "missing": ("no such directory", root / "allowed" / "missing"),
    }
    for name, (message, path) in refused.items():
        answer = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "c", PROMPTS[1])
    gone = server.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    # Loaded again under its name: served again (a new id inside the engine).
    assert server.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(made["c"])}).status_code == 200
    assert _complete(client, "c", PROMPTS[0]).choices[0].text == references["c"][0]


# -- configuration (no server) ------------------------------------------------------------------------


def test_flags_env_and_mindie_config(tmp_path, monkeypatch):
    base = tiny_checkpoint("llama")
    adapter = make_adapter(tmp_path / "a", base, r=4)
    model = ["--model", str(base)]
    config = parse_config(model + ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--lora-modules",
                                   f"a={adapter}", json.dumps({"name": "b", "path": str(adapter)})])
    assert config.engine.enable_lora and (config.engine.max_loras, config.engine.max_lora_rank) == (3, 8)
    assert [m.name for m in config.lora_modules] == ["a", "b"] and not config.allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert parse_config(model + ["--enable-lora"]).allow_runtime_lora_updating
    with pytest.raises(ValueError, match="need --enable-lora"):
        parse_config(model + ["--lora-modules", f"a={adapter}"])
    with pytest.raises(SystemExit):
        parse_config(model + ["--enable-lora", "--lora-modules", "no-equals-sign"])
    mapping = map_mindie_config({"BackendConfig": {"ModelDeployConfig": {"LoraModules": [
        {"name": "a", "path": "adapters/a", "baseModelName": "llama"}]}}}, "/etc/mindie")
    assert mapping.flags["enable_lora"] is True and not mapping.ignored
    (module,) = mapping.flags["lora_modules"]
    assert (module.name, module.path, module.base_model_name) == ("a", "/etc/mindie/adapters/a", "llama")


def test_runtime_routes_are_off_without_the_flag(serve):
    with serve(tiny_checkpoint("llama"), "--enable-lora") as server:
        answer = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert answer.status_code == 404 and "--allow-runtime-lora-updating" in answer.json()["error"]["message"]
