"""benchmarks/peers/serve_peers.py's pure parts: which EOS ids it bans, the bench_serving
arguments it builds, how a run is summarised (the servers themselves are never started here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.helpers import load_benchmark

load_benchmark("bench_serving")  # serve_peers imports it as a sibling module


def _load_serve_peers():
    """benchmarks/peers/serve_peers.py (not a package) as a module; it puts its own folder on
    sys.path for common.py."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "serve_peers.py"
    spec = importlib.util.spec_from_file_location("serve_peers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_peers"] = module
    spec.loader.exec_module(module)
    return module


peers = _load_serve_peers()


def test_every_eos_id_the_checkpoint_names_is_banned(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert peers.eos_ids(tmp_path) == [0, 2, 7]
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    assert peers.eos_ids(tmp_path) == []


def test_the_client_arguments_are_what_bench_serving_accepts(tmp_path):
    args = peers.parse_args(["--concurrency", "1,8", "--waves", "2", "--min-prompts", "8", "--output-len", "16"])
    argv = peers.bench_argv(args, "http://127.0.0.1:9", 8, tmp_path, [0, 2])
    parsed = peers.bench_serving.parse_args(argv)
    assert (parsed.concurrency, parsed.num_prompts, parsed.output_len) == (8, 16, 16)  # 2 waves of 8
    assert parsed.ban_token_ids == (0, 2) and parsed.temperature == 0 and parsed.tokenizer == str(tmp_path)
    single = peers.bench_serving.parse_args(peers.bench_argv(args, "http://127.0.0.1:9", 1, tmp_path, [2]))
    assert single.num_prompts == 8  # at least --min-prompts


def test_a_run_is_summarised_from_bench_serving_numbers():
    records = [peers.bench_serving.RequestRecord(start=0.0) for _ in range(2)]
    for record, (first, end) in zip(records, [(0.1, 1.1), (0.3, 1.3)]):
        record.ttft, record.end, record.output_tokens, record.prompt_tokens = first, end, 11, 5
        record.chunk_times, record.usage_reported = [first, end], True
    result = peers.bench_serving.aggregate(records, 2.0)
    row = peers.summary(result)
    assert row["output_tok_s"] == 11.0 and row["output_tokens"] == 22 and row["failed"] == 0
    assert abs(row["ttft_p50_ms"] - 200.0) < 1e-6 and abs(row["tpot_p50_ms"] - 100.0) < 1e-6
    assert "tok/s" in peers.format_row(row)
