"""The executor package's seams, without starting a rank: the ``mp`` rank channel's typed messages
round-trip through msgspec and refuse anything else with an error that says what it got, and each
backend takes from ``atb_plugin.engine.executor`` only the shared driver (``base``), so backends
never depend on each other."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import msgspec
import pytest

from atb_plugin.engine.executor.base import (
    Execute, Executed, Failed, Initialize, Initialized, Load, Loaded, MalformedRankMessage, Propose, Proposed, Stop,
    decode_from_rank, decode_to_rank, encode_message)
from atb_plugin.engine.model_runner import RunnerOutput
from atb_plugin.engine.scheduler import SchedulerOutput
from atb_plugin.engine.worker import WorkerInfo

EXECUTOR = Path(__file__).resolve().parents[1] / "atb_plugin" / "engine" / "executor"

TO_RANK = [
    Load(pickle.dumps({"model": "m"}), "tcp://127.0.0.1:1234", 120.0, 20),
    Initialize(48),
    Execute(pickle.dumps(SchedulerOutput({"a": 1}, [], {"a": [3]}, computed_tokens={"a": 7}))),
    Propose(["a", "b"], [12, 7], [3, 1]),
    Stop(),
]
FROM_RANK = [
    Loaded(WorkerInfo(available_kv_blocks=48, weight_bytes=1 << 20)),
    Initialized("eager (tensor parallel)"),
    Executed(pickle.dumps(RunnerOutput(sampled={"a": 5}, failed={"b": "why"}))),
    Proposed([[4, 9, 2], []]),
    Failed("Traceback (most recent call last):\n  ...\nValueError: no"),
]


@pytest.mark.parametrize("message", TO_RANK, ids=lambda m: type(m).__name__)
def test_messages_to_a_rank_round_trip(message):
    assert decode_to_rank(encode_message(message)) == message


@pytest.mark.parametrize("message", FROM_RANK, ids=lambda m: type(m).__name__)
def test_messages_from_a_rank_round_trip(message):
    decoded = decode_from_rank(encode_message(message))
    assert decoded == message and type(decoded) is type(message)


def test_what_the_payloads_carry_survives_the_channel():
    step = decode_to_rank(encode_message(TO_RANK[2]))
    assert pickle.loads(step.scheduler_output).computed_tokens == {"a": 7}
    loaded = decode_from_rank(encode_message(FROM_RANK[0]))
    assert isinstance(loaded.info, WorkerInfo) and loaded.info.available_kv_blocks == 48
    assert pickle.loads(decode_from_rank(encode_message(FROM_RANK[2])).runner_output).sampled == {"a": 5}


@pytest.mark.parametrize("data, says", [
    (b"\xc1", "malformed rank-channel message to a rank (1 bytes)"),  # not MessagePack at all
    (msgspec.msgpack.encode(("INIT", 48)), "to a rank"),  # the untyped tuple of old
    (msgspec.msgpack.encode({"type": "Initialize", "num_blocks": "48"}), "Expected `int`, got `str`"),
    (msgspec.msgpack.encode({"type": "Initialize"}), "missing required field `num_blocks`"),
    (msgspec.msgpack.encode({"type": "Initialize", "num_blocks": 4, "extra": 1}), "unknown field `extra`"),
    (msgspec.msgpack.encode({"type": "Reboot"}), "Invalid value 'Reboot'"),
])
def test_a_malformed_message_to_a_rank_is_refused_naming_the_fault(data, says):
    with pytest.raises(MalformedRankMessage, match="malformed rank-channel message to a rank") as caught:
        decode_to_rank(data)
    assert says in str(caught.value)


def test_each_direction_refuses_the_other_directions_messages():
    with pytest.raises(MalformedRankMessage, match="from a rank"):
        decode_from_rank(encode_message(Initialize(48)))
    with pytest.raises(MalformedRankMessage, match="to a rank"):
        decode_to_rank(encode_message(Initialized("captured")))
    missing = r"from a rank.*missing required field `weight_bytes` - at `\$\.info`"
    with pytest.raises(MalformedRankMessage, match=missing):
        decode_from_rank(msgspec.msgpack.encode({"type": "Loaded", "info": {"available_kv_blocks": 4}}))


def _executor_imports(path: Path) -> set[str]:
    """The modules of ``atb_plugin.engine.executor`` one file imports, at any depth (a function's
    import counts too), relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the package atb_plugin.engine.executor
                parent = ["atb_plugin", "engine", "executor"][:4 - node.level]
                module = ".".join(parent + ([module] if module else []))
            # "from atb_plugin.engine.executor import base" imports the submodule base
            names = [f"{module}.{alias.name}" if module == "atb_plugin.engine.executor" else module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names
                     if name == "atb_plugin.engine.executor" or name.startswith("atb_plugin.engine.executor."))
    return found


def test_backends_take_only_base_from_the_executor_package():
    files = sorted(p for p in EXECUTOR.glob("*.py") if p.name != "__init__.py")
    assert {p.name for p in files} >= {"base.py", "uniproc.py", "multiproc.py", "ray.py"}
    for path in files:
        imported = _executor_imports(path)
        if path.name == "base.py":
            assert imported == set(), f"base.py imports {sorted(imported)}: the driver knows no backend"
        else:
            assert imported == {"atb_plugin.engine.executor.base"}, \
                f"{path.name} imports {sorted(imported)} from the executor package: only base.py"
