"""deploy/: every Kubernetes manifest and Dockerfile agrees with the code it deploys. Nothing is
built or applied; each file is parsed, and

- every server container's arguments parse with our CLI (``parse_config``; the model path is
  swapped for a tiny checkpoint, the one thing a manifest cannot know here); its probes GET routes
  the server has, on the port it listens on; the grace period covers --shutdown-timeout plus the
  preStop pause; /dev/shm is a memory emptyDir; the Service and the InferencePool reach that port,
  the pool selects the Deployment's pods, the InferenceModel names the served model;
- each Dockerfile's entry point starts ``python -m atb_plugin.server`` (directly or through an
  entry script that execs it) with arguments our CLI parses and no CMD (arguments after the image
  name replace CMD), exposes the port they name, pins torch as setup.py does, never installs
  torchvision, installs xgrammar at setup.py's pin (structured output), and copies every
  package setup.py ships; the README's ``docker build`` / ``docker run`` lines name those
  Dockerfiles, publish the exposed port, give /dev/shm room and pass arguments our CLI parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from atb_plugin.server.api_server import routes
from atb_plugin.server.cli import parse_config
from atb_plugin.server.pooling_api import pooling_routes
from atb_plugin.testing.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GET_PATHS = {route.path for router in (routes, pooling_routes) for route in router.routes if "GET" in route.methods}


def documents() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def of_kind(kind: str) -> list[dict]:
    return [doc for doc in documents() if doc["kind"] == kind]


def parsed(args: list[str]):
    """Our CLI's config for ``args`` with the model swapped for a tiny checkpoint."""
    args = list(args)
    if "--model" in args:
        args[args.index("--model") + 1] = str(tiny_checkpoint("qwen2"))
    else:
        args += ["--model", str(tiny_checkpoint("qwen2"))]
    return parse_config(args)


def server_containers() -> list[tuple[dict, dict]]:
    found = [(deployment, container) for deployment in of_kind("Deployment")
             for container in deployment["spec"]["template"]["spec"]["containers"]
             if container["image"].startswith("atb-plugin") and "proxy" not in container.get("command", [])]
    assert found, "no Deployment runs the server"
    return found


def test_every_manifest_parses_and_says_what_it_is():
    kinds = [(doc["apiVersion"], doc["kind"]) for doc in documents()]
    assert ("apps/v1", "Deployment") in kinds and ("v1", "Service") in kinds
    assert ("inference.networking.x-k8s.io/v1alpha2", "InferencePool") in kinds
    assert all(doc["metadata"]["name"] for doc in documents())


def test_server_containers_parse_probe_real_routes_and_drain_in_time():
    for deployment, container in server_containers():
        config = parsed(container["args"])
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert config.port in ports.values() and config.host == "0.0.0.0"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in GET_PATHS, (probe, get["path"])
            assert ports.get(get["port"], get["port"]) == config.port, probe
        pause = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pause[0] == "sleep"
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= config.shutdown_timeout + float(pause[1]) + 5, (grace, config.shutdown_timeout)
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
        assert "huawei.com/Ascend910" in container["resources"]["limits"]


def test_the_service_and_the_inference_pool_reach_the_server():
    deployment, container = server_containers()[0]
    config = parsed(container["args"])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    named = {port["name"] for port in container["ports"]}
    for service in of_kind("Service"):
        if service["metadata"]["name"] != deployment["metadata"]["name"]:
            continue  # another workload's (the multi-node example's, checked below)
        assert service["spec"]["selector"].items() <= labels.items()
        assert all(port["targetPort"] in named or port["targetPort"] == config.port
                   for port in service["spec"]["ports"])
    pool = of_kind("InferencePool")[0]
    assert pool["spec"]["targetPortNumber"] == config.port
    assert pool["spec"]["selector"].items() <= labels.items()
    assert [m["spec"]["modelName"] for m in of_kind("InferenceModel")] == [config.served_model_name]
    assert all(m["spec"]["poolRef"]["name"] == pool["metadata"]["name"] for m in of_kind("InferenceModel"))


# -- Dockerfiles ---------------------------------------------------------------------------------------

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))


def entrypoint(path: Path) -> tuple[str, list[str]]:
    """What the image runs (``python -m atb_plugin.server``, directly or through an entry script
    that execs it with its arguments) and the server arguments the entry point adds."""
    words = [yaml.safe_load(rest) for kind, rest in instructions(path) if kind == "ENTRYPOINT"][-1]
    if words[:3] == ["python", "-m", "atb_plugin.server"]:
        return "python -m atb_plugin.server", words[3:]
    script = (DEPLOY / words[0]).read_text()
    assert 'exec python -m atb_plugin.server "$@"' in script, words[0]
    return "python -m atb_plugin.server", words[1:]


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_a_dockerfile_runs_our_server_as_the_cli_and_setup_py_expect(path):
    steps = instructions(path)
    _, args = entrypoint(path)
    assert not [rest for kind, rest in steps if kind == "CMD"]  # `docker run IMAGE ARGS` replaces CMD
    config = parsed(args)
    assert [int(rest) for kind, rest in steps if kind == "EXPOSE"] == [config.port] and config.host == "0.0.0.0"
    runs = " ".join(rest for kind, rest in steps if kind == "RUN")
    torch_pin = re.search(r'"(torch==[^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert torch_pin in runs and "torchvision" not in runs
    copied = {rest.split()[0] for kind, rest in steps if kind == "COPY"}
    packages = set(re.findall(r'"(\w+)"', re.search(r"include=\[([^]]*)\]", (ROOT / "setup.py").read_text()).group(1)))
    assert packages <= copied, packages - copied
    for source in copied:
        assert (ROOT / source).exists(), source


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_a_dockerfile_installs_structured_outputs_grammar_engine(path):
    """response_format json_object and tool_choice "required" need xgrammar (issue 45, item 2):
    each image installs it at the [structured] extra's pin, after the package (a later
    ``pip install .`` would not remove it), directly or through that extra."""
    pin = re.search(r'"structured": \["(xgrammar==[^"]+)"\]', (ROOT / "setup.py").read_text()).group(1)
    runs = [rest for kind, rest in instructions(path) if kind == "RUN"]
    installs = [i for i, rest in enumerate(runs) if pin in rest.split() or "structured" in rest]
    package = [i for i, rest in enumerate(runs) if re.search(r"pip install '?\.", rest)]
    assert installs and package and max(installs) >= min(package), (pin, runs)
    assert pin in (ROOT / "scripts" / "bootstrap.sh").read_text()  # the same version the tests run with


def readme_docker_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = re.sub(r"\\\n", " ", "\n".join(blocks)).splitlines()
    return [shlex.split(line.split("#")[0]) for line in lines if line.startswith("docker ")]


def test_the_readmes_docker_commands_match_the_dockerfiles():
    commands = readme_docker_commands()
    built = {}
    for words in commands:
        if words[1] == "build":
            dockerfile = ROOT / words[words.index("-f") + 1]
            assert dockerfile.is_file(), dockerfile
            built[words[words.index("-t") + 1]] = dockerfile
    runs = [words for words in commands if words[1] == "run"]
    assert built and sorted(next(w for w in words if w in built) for words in runs) == sorted(built)
    for words in runs:
        image = next(word for word in words if word in built)
        config = parsed(entrypoint(built[image])[1] + words[words.index(image) + 1:])
        exposed = [int(rest) for kind, rest in instructions(built[image]) if kind == "EXPOSE"]
        published = words[words.index("-p") + 1].split(":")
        assert int(published[1]) == exposed[0] == config.port
        assert any(word.startswith("--shm-size=") for word in words)


# -- the multi-node example (LeaderWorkerSet: Ray head + workers) -----------------------------------

def _shell_steps(container: dict) -> list[list[str]]:
    """A ``bash -c`` container's script as its ``&&``-joined commands, each split into words."""
    assert container["command"] == ["/bin/bash", "-c"]
    words = shlex.split(container["args"][0])
    steps, current = [], []
    for word in words:
        if word == "&&":
            steps.append(current)
            current = []
        else:
            current.append(word)
    return steps + [current]


def test_the_multinode_example_starts_ray_then_a_ray_executor_server_spanning_the_group():
    (group,) = of_kind("LeaderWorkerSet")
    template = group["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    leader_steps, worker_steps = _shell_steps(leader), _shell_steps(worker)
    head = next(step for step in leader_steps if step[:3] == ["ray", "start", "--head"])
    port = int(next(word for word in head if word.startswith("--port=")).split("=")[1])
    assert {p["name"]: p["containerPort"] for p in leader["ports"]}["ray-gcs"] == port
    assert ["exec", "ray", "start", f"--address=$(LWS_LEADER_ADDRESS):{port}", "--block"] == \
        [w for w in worker_steps[-1] if not w.startswith("--num-cpus")]
    server = leader_steps[-1]
    assert server[:2] == ["exec", "ascend-entrypoint.sh"]
    args = server[2:]
    # The model and the group's size are the two things this machine cannot host: a tiny checkpoint
    # at TP = 2 takes their place once the size is checked against the group's devices.
    tp = int(args[args.index("--tensor-parallel-size") + 1])
    devices = [c["resources"]["limits"]["huawei.com/Ascend910"] for c in (leader, worker)]
    assert tp == devices[0] + (size - 1) * devices[1], "every NPU of the group holds one rank"
    args[args.index("--tensor-parallel-size") + 1] = "2"
    config = parsed(args)
    assert config.engine.distributed_executor_backend == "ray"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert leader[probe]["httpGet"]["path"] in GET_PATHS
    assert "--port" in args and config.port == {p["name"]: p["containerPort"] for p in leader["ports"]}["http"]
    service = next(s for s in of_kind("Service") if s["metadata"]["name"] == group["metadata"]["name"])
    assert service["spec"]["selector"].items() <= template["leaderTemplate"]["metadata"]["labels"].items()
    runs = " ".join(rest for kind, rest in instructions(DEPLOY / "Dockerfile.ascend") if kind == "RUN")
    assert re.search(r"\.\[[^]]*\bray\b[^]]*\]", runs), "the image the group runs must install the [ray] extra"
