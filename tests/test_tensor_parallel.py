"""Tensor parallelism (``atb_plugin.distributed``, the sharded layers, ``MultiprocExecutor``) on
the CPU, offline, on the tiny checkpoints of every family.

1. Model level: each rank of a real gloo group (spawned processes on loopback) loads its shard
   of every family and runs a chunked prefill + decode (and, for the VL families, one image
   through the replicated encoder, merged into the prompt); the logits (BERT: the last hidden
   states) equal TP = 1's, and every rank holds the same bytes.
2. The simulated NPU: the same at float16 through both NPU kernel sets, over the ``hccl``
   backend (which the fake torch_npu routes to gloo), with the NPU ops called on every rank.
3. Through ``LLM``: TP = 2 (and TP = 4 for qwen2) gives TP = 1's greedy tokens and logprobs for
   every generative family — text prompts under preemption, a repeated prompt served from the
   prefix cache, an image chat for the VL families — and TP = 1's embeddings for the pooling
   models.
4. Start-up errors name the numbers and the fix; a rank that fails while loading its shard
   fails ``LLM(...)`` with that rank's traceback and leaves no rank process behind.
5. Each rank holds a shard: its parameters are what the config says a shard holds, and the
   executor reports fewer weight bytes per rank than TP = 1's.

Tolerances. float32: 1e-4 absolute on logits, hidden states, logprobs and embeddings. A shard
computes the same products as TP = 1; only the order in which the partial sums are added
differs (each all-reduce adds the ranks' partial row-parallel outputs, TP = 1 sums all columns
in one GEMM), which moves the float32 results by a few ulps: observed max |diff| ~2.5e-6 on
logits of magnitude O(1-5), 40x below the tolerance. float16 (simulated NPU): 0.02 on logits:
each rank's partial output is rounded to fp16 (11 significant bits, ~2e-3 at these magnitudes)
before the reduce adds them, so every all-reduce can move a value by an ulp or two; observed
max |diff| 0.0049 over two layers, 4x below. Greedy tokens must be equal: the float32 logit
differences are far below the gap between a greedy token and the runner-up on these prompts
(checked: the same seeds always pick the same tokens).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import socket
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from atb_plugin.testing.tiny import tiny_checkpoint

FAMILIES = ["qwen2", "llama", "qwen2_vl", "qwen2_5_vl", "llava", "qwen_vl", "bert"]
VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "llava", "qwen_vl"]
FP32_ATOL = 1e-4
FP16_ATOL = 0.02
RANK_TIMEOUT_S = 300  # a whole spawned group (interpreter start-up, loading, running every family)


# ------------------------------------------------------------------------------------------------
# Spawned rank processes (model level): a real process group on loopback, one per test group.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_entry(fn, rank: int, size: int, init_method: str, queue, args) -> None:
    """A spawned rank: ``fn(rank, size, init_method, *args)``; its result (or its traceback) goes
    to ``queue``. ``fn`` joins the group itself (the backend depends on the platform it sets up)."""
    from atb_plugin import distributed

    torch.set_num_threads(1)  # two cores on the CI machine, several ranks
    try:
        result = fn(rank, size, init_method, *args)
    except BaseException:  # noqa: BLE001 - reported to the test, which fails naming the rank
        queue.put((rank, False, traceback.format_exc()))
    else:
        queue.put((rank, True, result))
    finally:
        distributed.destroy_tensor_parallel()


def run_ranks(fn, size: int, *args, timeout: float = RANK_TIMEOUT_S) -> list:
    """Spawn ``size`` ranks running ``fn`` and return their results in rank order. A rank that
    fails (or dies, or the group running past ``timeout``) fails the caller with its traceback;
    every rank process is gone when this returns."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as env:
        # gloo binds the interface the host name resolves to unless told: loopback only.
        env.setenv("GLOO_SOCKET_IFNAME", "lo")
        env.setenv("MASTER_ADDR", "127.0.0.1")
        procs = [ctx.Process(target=_rank_entry, args=(fn, rank, size, init_method, queue, args), daemon=True)
                 for rank in range(size)]
        for proc in procs:
            proc.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            try:
                rank, ok, payload = queue.get(timeout=1)
            except queue_module.Empty:
                dead = [p for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise AssertionError(f"rank process {procs.index(dead[0])} died (exit code {dead[0].exitcode})")
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(size)) - set(results))} did not answer "
                                         f"within {timeout} s") from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {size} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(results) == size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        queue.close()
        queue.join_thread()
    return [results[rank] for rank in range(size)]


def join_group(rank: int, size: int, init_method: str, backend: str = "gloo") -> None:
    from atb_plugin import distributed

    distributed.init_tensor_parallel(rank, size, backend, init_method, 60)


# -- what each rank (and the TP = 1 reference, in the test process) computes ------------------------

# A prompt of 13 tokens: prefill of 5, a chunk of 6, then two single-token decode steps.
CHUNKS = [(0, 5), (5, 11), (11, 12), (12, 13)]


def _load(family: str, dtype=None):
    from routers import get_router

    path = tiny_checkpoint(family)
    model_cls = get_router(path).model_cls
    return model_cls.from_pretrained(path) if dtype is None else model_cls.from_pretrained(path, dtype=dtype)


def _text_logits(model, block_size: int = 4) -> np.ndarray:
    from atb_plugin.testing.sequence import SequenceRunner

    ids = torch.randint(0, 500, (CHUNKS[-1][1],), generator=torch.Generator().manual_seed(0))
    runner = SequenceRunner(model, 32 if block_size < 32 else block_size, block_size=block_size)
    return torch.cat([runner.step(ids[a:b]) for a, b in CHUNKS]).float().numpy()


def _image_pixels(family: str):
    """Random pixels of one image in the form the family's encoder takes, and its grid_thw."""
    generator = torch.Generator().manual_seed(1)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        grid = (1, 4, 4)  # 16 patches of 3x2x14x14 -> 4 LLM tokens
        return torch.randn(16, 1176, generator=generator), grid
    side = 56 if family == "llava" else 112  # LLaVA: 16 tokens; Qwen-VL: 256 resampler queries
    return torch.randn(1, 3, side, side, generator=generator), None


@torch.no_grad()
def _image_logits(model, family: str) -> tuple[np.ndarray, np.ndarray]:
    """``(image features, logits)`` of a prompt [3 text tokens, the image block, 5 text tokens]
    run as a prefill cut inside the image block, the rest, and one decode step."""
    from atb_plugin.testing.sequence import SequenceRunner

    pixels, grid = _image_pixels(family)
    features = model.get_multimodal_embeddings(pixels, grid)
    slots = features.shape[0]
    text = torch.randint(0, 500, (8,), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([text[:3], torch.full((slots,), model.media_layout.placeholder_id), text[3:]])
    embeds = model.get_input_embeddings(ids)
    embeds[3:3 + slots] = features
    length = ids.shape[0]
    if hasattr(model, "get_mrope_positions"):
        positions, delta = model.get_mrope_positions(ids, [grid])
        decode_position = model.decode_positions(length, 1, delta)
    else:
        positions, decode_position = torch.arange(length), torch.tensor([length])
    runner = SequenceRunner(model, length + 1)
    cut = 3 + slots // 2
    logits = [runner.step(ids[:cut], positions[..., :cut], inputs_embeds=embeds[:cut]),
              runner.step(ids[cut:], positions[..., cut:], inputs_embeds=embeds[cut:]),
              runner.step(torch.tensor([7]), decode_position)]
    return features.numpy(), torch.cat(logits).numpy()


@torch.no_grad()
def _bert_hidden(model) -> np.ndarray:
    ids = torch.randint(0, 400, (11,), generator=torch.Generator().manual_seed(0))
    return model(ids, torch.tensor([0, 5, 11])).numpy()  # two packed sequences


def family_outputs(family: str) -> dict:
    """Everything the model-level test compares, for one family at this process's TP size."""
    model = _load(family)
    out = {"params": sum(p.numel() for p in model.parameters())}
    if family == "bert":
        out["hidden"] = _bert_hidden(model)
        return out
    out["logits"] = _text_logits(model)
    if family in VL_FAMILIES:
        out["image_features"], out["image_logits"] = _image_logits(model, family)
    return out


def rank_all_families(rank: int, size: int, init_method: str) -> dict:
    join_group(rank, size, init_method)
    return {family: family_outputs(family) for family in FAMILIES}


def rank_npu(rank: int, size: int, init_method: str) -> dict:
    """qwen2 in float16 on the simulated NPU, both kernel sets, over the platform's backend."""
    from atb_plugin.platform import use_platform
    from atb_plugin.testing import fake_torch_npu

    fake = fake_torch_npu.install(device_count=size)
    with use_platform("npu") as platform:
        platform.bind_device(rank)
        join_group(rank, size, init_method, platform.dist_backend)
        out = {"dist_backend": platform.dist_backend, "backend": torch.distributed.get_backend(),
               "device": fake.module.npu.current_device()}
        for kernels in ("atb", "fia"):
            os.environ["ATB_PLUGIN_NPU_KERNELS"] = kernels
            before = fake.module.calls.copy()
            logits = _text_logits(_load("qwen2", torch.float16), block_size=128)
            out[kernels] = (logits, dict(fake.module.calls - before))
    return out


@pytest.fixture(scope="module")
def tp1_outputs():
    """TP = 1 in this process (never in a group: tp_size() is 1 here)."""
    from atb_plugin import distributed

    assert distributed.tp_size() == 1
    return {family: family_outputs(family) for family in FAMILIES}


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda tp: f"tp{tp}")
def group_outputs(request):
    """``(tp, [each rank's outputs of every family])``: one spawned group per TP size."""
    return request.param, run_ranks(rank_all_families, request.param)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_model_equals_tp1(family, group_outputs, tp1_outputs):
    """Chunked prefill + decode logits (BERT: last hidden states) at TP equal TP = 1's within
    1e-4 (float32; only the all-reduce's summation order differs), on every rank alike: each
    rank samples from its own copy of the logits, so they must agree bit for bit. VL families
    also run one image through the encoder (replicated: the same features on every rank as at
    TP = 1) merged into the prompt. Every rank holds fewer parameters than TP = 1."""
    tp, ranks = group_outputs
    reference = tp1_outputs[family]
    keys = set(reference) - {"params"}
    assert keys and all(set(rank[family]) == set(reference) for rank in ranks)
    for key in keys:
        assert max_diff(ranks[0][family][key], reference[key]) <= FP32_ATOL, (family, tp, key)
        for rank, outputs in enumerate(ranks[1:], 1):
            assert np.array_equal(outputs[family][key], ranks[0][family][key]), (family, tp, key, rank)
    assert all(rank[family]["params"] < reference["params"] for rank in ranks), (
        [rank[family]["params"] for rank in ranks], reference["params"])


# ------------------------------------------------------------------------------------------------
# The simulated NPU: float16, both kernel sets, the "hccl" backend.


@pytest.fixture(scope="module")
def npu_group():
    return run_ranks(rank_npu, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["atb", "fia"])
def test_npu_tp2_equals_tp1_in_float16_over_hccl(kernels, npu_group, fake_npu, monkeypatch):
    """Each rank bound to its own (simulated) NPU, in an ``hccl`` group; logits within 0.02 of
    TP = 1's in float16 (see the module docstring), the same on both ranks, and the NPU
    kernels (not the CPU's) ran on each rank."""
    from atb_plugin.platform import use_platform

    monkeypatch.setenv("ATB_PLUGIN_NPU_KERNELS", kernels)
    with use_platform("npu"):
        before = fake_npu.module.calls.copy()
        reference = _text_logits(_load("qwen2", torch.float16), block_size=128)
        reference_calls = dict(fake_npu.module.calls - before)
    attention = "npu_fused_infer_attention_score" if kernels == "fia" else "_npu_paged_attention"
    assert reference_calls.get(attention, 0) > 0, reference_calls
    for rank, outputs in enumerate(npu_group):
        assert outputs["dist_backend"] == outputs["backend"] == "hccl"
        assert outputs["device"] == rank
        logits, calls = outputs[kernels]
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
        assert max_diff(logits, reference) <= FP16_ATOL, (kernels, rank)
        assert np.array_equal(logits, npu_group[0][kernels][0])
        assert calls.get(attention, 0) > 0, (rank, calls)
        assert calls == reference_calls, (rank, calls)  # the same NPU ops, as often, as TP = 1


# ------------------------------------------------------------------------------------------------
# Through LLM: the executor's rank processes, the scheduler in the core, sampling on every rank.

GENERATIVE = ["qwen2", "llama", "qwen2_vl", "llava", "qwen_vl"]
LLM_VL = ["qwen2_vl", "llava", "qwen_vl"]
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello! How are you today?",
           "Numbers such as 3.14 and 2.71", "Once upon a time there was a little robot",
           "The library opens at nine in the morning", "Please summarise the following paragraph",
           "The river runs through the city", "What is in this picture?"]
# 78 tokens: four full 16-token blocks are cached after the first run.
REPEATED = ("Each request carries a conversation: a system prompt, the user's questions and the "
            "assistant's replies. ") * 2
GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
# Every rank samples for itself (worker.py): seeded draws must agree with TP = 1's too.
SEEDED = dict(temperature=1.0, top_p=0.9, presence_penalty=0.5, max_tokens=20, ignore_eos=True)
BLOCK_SIZE = 16
# KV blocks (the null block included): one request's image prompt fits (Qwen-VL's is 311
# tokens), the 8 prompts above at 10-20 tokens + 40 generated (4 blocks each, 32 in all) do not:
# they run concurrently and are preempted.
KV_BLOCKS = {"qwen_vl": 24}
DEFAULT_KV_BLOCKS = 12


def image_chat():
    from tests.server_helpers import data_url

    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed=3)}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def rank_pids(llm) -> list[int]:
    executor = llm.engine.core.executor
    return [rank.process.pid for rank in getattr(executor, "ranks", [])]


def worker_processes() -> list:
    """Rank processes (``python -m atb_plugin.engine.executor.multiproc``) descending from this test process."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            command = " ".join(child.cmdline())
            if "atb_plugin.engine.executor.multiproc" in command and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
    return found


def unseeded_and_recomputed(llm) -> list[tuple[list[float], list[float]]]:
    """Unseeded random sampling (every rank draws from its global generator, seeded alike at
    start), then the prompt + sampled tokens again as a prompt: ``(the sampled tokens' logprobs
    as generated, as recomputed from the prompt logprobs)`` per request. Ranks that drew
    different tokens would have written different tokens' keys and values into their KV heads;
    the logits of the tokens after the first such draw would then differ from the recompute's."""
    from atb_plugin import SamplingParams

    pairs = []
    for output in llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True,
                                                           logprobs=0)):
        ids = output.prompt_token_ids + output.outputs[0].token_ids
        # Prompt logprobs take no prefix-cache hits: the whole sequence is computed again.
        again = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        start = len(output.prompt_token_ids)
        pairs.append(([entry.logprob for entry in output.outputs[0].logprobs],
                      [entry.logprob for entry in again.prompt_logprobs[start:]]))
    return pairs


def generate_workload(family: str, tp: int) -> dict:
    """Run the module's requests through ``LLM(tensor_parallel_size=tp)`` and close it; returns
    the outputs and what the core observed (preemptions, prefix-cache hits, weight bytes)."""
    from atb_plugin import LLM, SamplingParams

    params = SamplingParams(**GREEDY)
    with LLM(tiny_checkpoint(family), tensor_parallel_size=tp, block_size=BLOCK_SIZE,
             kv_cache_blocks=KV_BLOCKS.get(family, DEFAULT_KV_BLOCKS)) as llm:
        pids = rank_pids(llm)
        result = {"batch": llm.generate(PROMPTS, params),
                  "preemptions": llm.engine.core.scheduler.num_preemptions,
                  "repeated": [llm.generate(REPEATED, params)[0] for _ in range(2)],
                  "images": [llm.chat(image_chat(), params)[0] for _ in range(2)] if family in LLM_VL else [],
                  "sampled": llm.generate(PROMPTS[:3], [SamplingParams(**SEEDED, seed=seed) for seed in range(3)]),
                  "unseeded": unseeded_and_recomputed(llm),
                  "weight_bytes": list(llm.engine.core.executor.weight_bytes),
                  "kv_cache_blocks": llm.engine.core.kv_cache_blocks}
    result["pids"] = pids
    return result


POOLING = {  # family -> (LLM arguments, call)
    "bert": ({"runner": "pooling"}, "embed"),
    "qwen2": ({"runner": "pooling"}, "embed"),  # a generative checkpoint converted to embed
    "bert_cross_encoder": ({}, "score"),
    "qwen2_seq_cls": ({}, "classify"),
}


def pooling_workload(family: str, tp: int) -> np.ndarray:
    """What the pooling model answers for a few texts (one row per text; scores: one per pair)."""
    from atb_plugin import LLM

    arguments, call = POOLING[family]
    texts = PROMPTS[:4]
    with LLM(tiny_checkpoint(family), tensor_parallel_size=tp, **arguments) as llm:
        assert llm.engine.config.runner == "pooling"
        if call == "embed":
            return np.stack([np.asarray(o.outputs.embedding) for o in llm.embed(texts)])
        if call == "score":
            return np.array([[o.outputs.score] for o in llm.score(texts[0], texts[1:])])
        return np.stack([np.asarray(o.outputs.probs) for o in llm.classify(texts)])


class Memo:
    """Results computed once per module, failures too (a failed start is not retried per test)."""

    def __init__(self, fn):
        self.fn, self.cache = fn, {}

    def __call__(self, *key):
        if key not in self.cache:
            try:
                self.cache[key] = (True, self.fn(*key))
            except Exception as error:  # noqa: BLE001 - re-raised for every test that asks
                self.cache[key] = (False, error)
        ok, value = self.cache[key]
        if not ok:
            raise value
        return value


@pytest.fixture(scope="module")
def generated():
    """``generated(family, tp)``: ``generate_workload``'s result, run once per module."""
    return Memo(generate_workload)


@pytest.fixture(scope="module")
def pooled():
    return Memo(pooling_workload)


def assert_same_answers(got, expected, what: str) -> None:
    """Equal greedy tokens; each position's sampled-token logprob, and the first step's top-5,
    within FP32_ATOL."""
    # Image blocks carry metadata slots (negative ids: the shared-memory handle, store-specific).
    assert [max(t, -1) for t in got.prompt_token_ids] == [max(t, -1) for t in expected.prompt_token_ids], what
    ours, theirs = got.outputs[0], expected.outputs[0]
    assert ours.token_ids == theirs.token_ids, what
    assert ours.text == theirs.text, what
    assert len(ours.logprobs) == len(theirs.logprobs) == len(theirs.token_ids), what
    for step, (a, b) in enumerate(zip(ours.logprobs, theirs.logprobs)):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= FP32_ATOL, (what, step, a, b)
    first, reference = ours.logprobs[0], theirs.logprobs[0]
    assert first.top_token_ids == reference.top_token_ids, what
    np.testing.assert_allclose(first.top_logprobs, reference.top_logprobs, rtol=0, atol=FP32_ATOL, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERATIVE)
def test_llm_tp2_generates_as_tp1_under_preemption(family, generated):
    """8 concurrent greedy requests in a KV cache too small for them: the core preempts and
    recomputes at both sizes alike, and TP = 2's tokens and logprobs are TP = 1's."""
    tp1, tp2 = generated(family, 1), generated(family, 2)
    assert tp1["kv_cache_blocks"] == tp2["kv_cache_blocks"] == KV_BLOCKS.get(family, DEFAULT_KV_BLOCKS)
    assert tp2["preemptions"] > 0 and tp2["preemptions"] == tp1["preemptions"]
    for index, (got, expected) in enumerate(zip(tp2["batch"], tp1["batch"], strict=True)):
        assert_same_answers(got, expected, f"{family} prompt {index}")


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERATIVE)
def test_llm_tp2_prefix_cache_hits_give_the_same_answer(family, generated):
    """The same prompt twice: the second run reuses its four full blocks at TP = 2 (every rank's
    shard of those blocks) and still answers as TP = 1."""
    tp1, tp2 = generated(family, 1), generated(family, 2)
    first, again = tp2["repeated"]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE == 64
    for got, expected in zip(tp2["repeated"], tp1["repeated"], strict=True):
        assert_same_answers(got, expected, f"{family} repeated prompt")


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERATIVE)
def test_llm_tp2_seeded_sampling_equals_tp1(family, generated):
    """Random sampling with a seed per request (temperature 1, top-p, a presence penalty): each
    rank draws from the same per-request generator on the same logits, and the tokens are
    TP = 1's."""
    tp1, tp2 = generated(family, 1), generated(family, 2)
    for got, expected in zip(tp2["sampled"], tp1["sampled"], strict=True):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids, family
        assert len(set(got.outputs[0].token_ids)) > 3  # sampled, not a greedy loop


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERATIVE)
def test_llm_tp2_ranks_draw_the_same_unseeded_tokens(family, generated):
    """Unseeded sampling cannot be compared with TP = 1 (another generator), but the ranks must
    agree with each other: each sampled token's logprob equals its logprob recomputed from the
    finished sequence within 1e-4 (rank 1 drawing other tokens moves them by ~1: checked by
    seeding rank 1 differently)."""
    for generated_logprobs, recomputed in generated(family, 2)["unseeded"]:
        assert len(generated_logprobs) == len(recomputed) == 16
        np.testing.assert_allclose(generated_logprobs, recomputed, rtol=0, atol=FP32_ATOL, err_msg=family)


@pytest.mark.slow
@pytest.mark.parametrize("family", LLM_VL)
def test_llm_tp2_image_chat_equals_tp1(family, generated):
    """An image chat (the replicated encoder on every rank, the image read from shared memory by
    each), asked twice: the second time its prefix (image included) comes from the cache."""
    tp1, tp2 = generated(family, 1), generated(family, 2)
    first, again = tp2["images"]
    assert first.num_cached_tokens == 0
    # Every full block but the one holding the last prompt token (its logits must be computed).
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    for got, expected in zip(tp2["images"], tp1["images"], strict=True):
        assert_same_answers(got, expected, f"{family} image chat")


@pytest.mark.slow
def test_llm_tp4_replicates_kv_heads_and_generates_as_tp1(generated):
    """qwen2 has 4 query heads and 2 KV heads: at TP = 4 each KV head is held by two ranks."""
    tp1, tp4 = generated("qwen2", 1), generated("qwen2", 4)
    assert tp4["preemptions"] == tp1["preemptions"] > 0
    for index, (got, expected) in enumerate(zip(tp4["batch"] + tp4["repeated"], tp1["batch"] + tp1["repeated"],
                                                strict=True)):
        assert_same_answers(got, expected, f"qwen2 tp4 prompt {index}")
    assert tp4["repeated"][1].num_cached_tokens == 64
    for got, expected in zip(tp4["sampled"], tp1["sampled"], strict=True):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    for generated_logprobs, recomputed in tp4["unseeded"]:
        np.testing.assert_allclose(generated_logprobs, recomputed, rtol=0, atol=FP32_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("family", POOLING)
def test_llm_tp2_pooling_equals_tp1(family, pooled):
    """BERT (a native embedding model) and qwen2 converted to embed (runner="pooling"): the
    pooled, normalised embeddings at TP = 2 are TP = 1's within 1e-4; so are a BERT
    cross-encoder's scores and a qwen2 sequence classifier's probabilities (their heads are
    replicated on every rank)."""
    tp1, tp2 = pooled(family, 1), pooled(family, 2)
    assert tp1.shape == tp2.shape and tp1.shape[0] >= 3 and np.isfinite(tp1).all()
    if POOLING[family][1] == "embed":
        np.testing.assert_allclose(np.linalg.norm(tp2, axis=1), 1, atol=1e-5)
    assert max_diff(tp2, tp1) <= FP32_ATOL


@pytest.mark.slow
def test_llm_rank_processes_are_gone_after_close(generated):
    import psutil

    pids = generated("qwen2", 2)["pids"]
    assert len(pids) == 2
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    assert worker_processes() == []


# ------------------------------------------------------------------------------------------------
# Start-up errors.


@pytest.mark.parametrize("tp", [3, 8])
def test_heads_that_do_not_split_name_both_numbers_and_the_fix(tp):
    from atb_plugin.engine.config import EngineConfig

    with pytest.raises(ValueError) as caught:
        EngineConfig(model=str(tiny_checkpoint("qwen2")), tensor_parallel_size=tp)  # 4 heads
    message = str(caught.value)
    assert f"num_attention_heads (4) is not divisible by tensor_parallel_size ({tp})" in message
    assert "choose a tensor_parallel_size that divides 4" in message


def test_kv_heads_that_neither_split_nor_replicate_are_refused():
    from atb_plugin.engine.config import EngineConfig

    path = str(tiny_checkpoint("qwen2"))
    EngineConfig(model=path, tensor_parallel_size=4)  # 2 KV heads over 4 ranks: each held twice
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and tensor_parallel_size \(2\)"):
        EngineConfig(model=path, tensor_parallel_size=2, hf_overrides={"num_key_value_heads": 3})


@pytest.mark.parametrize("device_ids", [[0], [0, 1, 2], [1, 1]])
def test_device_ids_must_name_one_distinct_device_per_rank(device_ids):
    from atb_plugin.engine.config import EngineConfig

    with pytest.raises(ValueError) as caught:
        EngineConfig(model=str(tiny_checkpoint("qwen2")), tensor_parallel_size=2, device_ids=device_ids)
    message = str(caught.value)
    assert f"device_ids = {device_ids}: give 2 distinct device indices, one per tensor-parallel rank" in message


def test_more_ranks_than_npus_is_refused_before_anything_starts(fake_npu):
    from atb_plugin import LLM
    from atb_plugin.engine.config import EngineConfig

    path = str(tiny_checkpoint("qwen2"))
    assert fake_npu.module.npu.device_count() == 1
    with pytest.raises(ValueError) as caught:
        LLM(path, device="npu", tensor_parallel_size=2)
    message = str(caught.value)
    assert "tensor_parallel_size 2 (device ids [0, 1]) needs 2 npu devices, this machine has 1" in message
    assert "lower --tensor-parallel-size or fix the device ids" in message
    with pytest.raises(ValueError, match=r"needs 4 npu devices, this machine has 1"):
        EngineConfig(model=path, device="npu", tensor_parallel_size=2, device_ids=(0, 3))
    assert worker_processes() == []


def _truncated_file(directory: Path) -> str:
    """Only the first half of model.safetensors: every rank fails to open it."""
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:len(data) // 2])
    return "rank"


def _short_embedding(directory: Path) -> str:
    """An embedding with 300 of the config's 515 rows: rank 0 (rows 0-257) loads its shard,
    rank 1 (rows 258-514) finds them missing."""
    from safetensors.torch import load_file, save_file

    state = load_file(directory / "model.safetensors")
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:300].clone()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return "rank 1"


@pytest.mark.slow
@pytest.mark.parametrize("corrupt, expected", [
    (_truncated_file, "SafetensorError"),
    (_short_embedding, "model.embed_tokens.weight: checkpoint shape (300, 64) is too small for rows [258, 515)"),
], ids=["truncated-file", "short-embedding"])
def test_a_rank_that_fails_to_load_fails_llm_with_its_traceback(corrupt, expected):
    from atb_plugin import LLM
    from atb_plugin.engine.executor import RankFailed
    from tests.helpers import copy_checkpoint

    with tempfile.TemporaryDirectory(prefix="atb-tp-broken-") as directory:
        path = copy_checkpoint(tiny_checkpoint("qwen2"), Path(directory))
        who = corrupt(path)
        with pytest.raises(RankFailed) as caught:
            LLM(str(path), tensor_parallel_size=2)
    message = str(caught.value)
    assert f"tensor-parallel {who}" in message and "failed to load its shard" in message, message
    assert "Traceback (most recent call last)" in message and "load_model" in message, message
    assert expected in message.splitlines()[-1], message  # the tail: the exception itself
    assert worker_processes() == []  # every rank stopped, none orphaned


# ------------------------------------------------------------------------------------------------
# Weight bytes: each rank holds a shard.


def decoder_shard_params(config: dict, tp: int) -> int:
    """Parameters of one rank of tiny qwen2 (tied embedding, q/k/v biases) at ``tp``: the
    vocabulary rows ``ceil(vocab / tp)``, ``heads / tp`` query heads, ``max(1, kv / tp)`` KV
    heads, ``intermediate / tp`` MLP features; norms replicated."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = hidden // heads, config["intermediate_size"] // tp
    q, kv_local = heads // tp * head_dim, max(1, kv // tp) * head_dim
    layer = (q + 2 * kv_local) * (hidden + 1) + hidden * q + 3 * inter * hidden + 2 * hidden
    return -(-config["vocab_size"] // tp) * hidden + config["num_hidden_layers"] * layer + hidden


def qwen2_config() -> dict:
    import json

    return json.loads((tiny_checkpoint("qwen2") / "config.json").read_text())


def test_shard_parameters_are_what_the_config_says(group_outputs, tp1_outputs):
    """tiny qwen2 (hidden 64, 4 heads, 2 KV heads, intermediate 128, vocab 515, 2 layers):
    107264 parameters; a TP = 2 rank holds 53824 (ratio 0.502: everything halves but the norms
    and the padded vocabulary row), a TP = 4 rank 29152 (0.272: KV heads replicated)."""
    tp, ranks = group_outputs
    config = qwen2_config()
    assert tp1_outputs["qwen2"]["params"] == decoder_shard_params(config, 1) == 107264
    assert [rank["qwen2"]["params"] for rank in ranks] == [decoder_shard_params(config, tp)] * tp
    assert decoder_shard_params(config, 2) == 53824 and decoder_shard_params(config, 4) == 29152


@pytest.mark.slow
def test_each_rank_reports_fewer_weight_bytes_than_tp1(generated):
    """``executor.weight_bytes``: one entry per rank, all alike, each about half of TP = 1's at
    TP = 2 and a bit over a quarter at TP = 4, where the KV heads are replicated (the config
    gives 0.502 and 0.272 for the parameters, test_shard_parameters_are_what_the_config_says;
    the CPU's packed layouts pad each rank's linear weights to whole 64-row panels, which moves
    the ratio a little: at most 0.6 and 0.35 here)."""
    tp1 = generated("qwen2", 1)["weight_bytes"]
    tp2 = generated("qwen2", 2)["weight_bytes"]
    tp4 = generated("qwen2", 4)["weight_bytes"]
    assert len(tp1) == 1 and len(tp2) == 2 and len(tp4) == 4
    assert len(set(tp2)) == 1 and len(set(tp4)) == 1
    assert 0.45 <= tp2[0] / tp1[0] <= 0.6, (tp1, tp2)
    assert 0.2 <= tp4[0] / tp1[0] <= 0.35, (tp1, tp4)


@pytest.mark.slow
def test_reported_weight_bytes_include_the_linear_weights(generated):
    """What a rank reports holds at least its shard's float32 parameters (packing may add
    padding, never drop a weight)."""
    config = qwen2_config()
    for tp in (1, 2):
        reported = generated("qwen2", tp)["weight_bytes"]
        assert all(b >= 4 * decoder_shard_params(config, tp) for b in reported), (tp, reported)
