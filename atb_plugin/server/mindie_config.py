"""Read a MindIE Service ``config.json`` and map it onto this server's options.

So a MindIE deployment can switch over with its existing config file. Mapped fields
(``MindieMapping.flags`` keys are the server's option names, in vLLM's spelling)::

    ServerConfig.ipAddress                              -> host
    ServerConfig.port                                   -> port
    BackendConfig.npuDeviceIds  ([[0, 1]])              -> devices [0, 1] and, in .env,
                                                           ASCEND_RT_VISIBLE_DEVICES="0,1"
    BackendConfig.tokenizerProcessNumber                -> tokenizer_workers
    BackendConfig.ModelDeployConfig.maxSeqLen           -> max_model_len
    BackendConfig.ModelDeployConfig.maxInputTokenLen    -> max_input_tokens (a separate limit
                                                           on the prompt, as in MindIE)
    ...ModelDeployConfig.ModelConfig[0].modelName       -> served_model_name
    ...ModelDeployConfig.ModelConfig[0].modelWeightPath -> model
    ...ModelDeployConfig.ModelConfig[0].worldSize       -> tensor_parallel_size (ranks use the
                                                           npuDeviceIds devices, renumbered 0..)
    ...ModelDeployConfig.ModelConfig[0].npuMemSize > 0  -> kv_cache_bytes (GiB -> bytes;
                                                           -1, MindIE's "automatic", maps to nothing)
    BackendConfig.ScheduleConfig.cacheBlockSize         -> block_size
    BackendConfig.ScheduleConfig.maxBatchSize           -> max_num_seqs
    BackendConfig.ScheduleConfig.maxPrefillTokens       -> max_num_batched_tokens
    BackendConfig.ScheduleConfig.maxIterTimes           -> max_new_tokens (MindIE caps every
                                                           request's output at it: the same
                                                           rule as generation_config's
                                                           max_new_tokens)
    ...ModelDeployConfig.LoraModules                    -> enable_lora, lora_modules (each
      [{"name", "path", "baseModelName"}]                  entry an adapter served by name;
                                                           docs/lora.md)
    ServerConfig.e2eTimeout / tokenTimeout (seconds)    -> request_timeout / token_timeout
    ServerConfig.httpsEnabled                           -> require_https: with it true, a missing
                                                           certificate is a start-up error; absent,
                                                           it is true when a tls* field below is
                                                           set (MindIE's default is true), and a
                                                           note says so
      tlsCert, tlsPk, tlsPkPwd                          -> ssl_certfile, ssl_keyfile,
                                                           ssl_keyfile_password_file (the file must
                                                           hold the plain password: MindIE's
                                                           KMC-encrypted form cannot be read here)
      tlsCaPath + tlsCaFile                             -> ssl_ca_certs, and ssl_cert_reqs
                                                           "required" (MindIE's mutual TLS)
      tlsCrlPath + tlsCrlFiles, tlsCrl                  -> ssl_crl
      (relative paths: from the config file's folder; with httpsEnabled false they are unused,
      and a note says so)

Every other field lands in ``MindieMapping.ignored`` (dotted paths, ``ModelConfig[0]`` style,
with the reason in ``.reasons``) when it is unknown or asks for something this server does not
do (a separate metrics port...). Fields that change nothing here stay silent:
those at their neutral value (``truncation: false``...) and certificate paths of endpoints this
server does not have (management, inter-process, inter-node TLS). Fields that are mapped or checked must have MindIE's types, or
``ValueError`` says which one is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MindieMapping", "load_mindie_config", "map_mindie_config"]


@dataclass
class MindieMapping:
    flags: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # ignored path -> why it has no effect here
    notes: list[str] = field(default_factory=list)  # how MindIE's defaults were read: logged at start-up


# -- value checks --------------------------------------------------------------------------------


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _int(path: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path} must be an integer, got {_type_name(value)} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{path} must be {bounds}, got {value}")
    return value


def _positive(path: str, value) -> int:
    return _int(path, value, minimum=1)


def _port(path: str, value) -> int:
    return _int(path, value, 1, 65535)


def _text(path: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{path} must be a non-empty string, got {_type_name(value)} {value!r}")
    return value


def _bool(path: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{path} must be true or false, got {_type_name(value)} {value!r}")
    return value


# -- the schema ----------------------------------------------------------------------------------
# A field's rule: Flag (mapped), Inert (silent), Neutral (silent at its neutral value, else
# ignored with a reason), Unsupported (always ignored with a reason), a dict (a nested object)
# or Custom (a _Mapper method).


@dataclass(frozen=True)
class Flag:
    name: str
    check: Callable[[str, Any], Any]


@dataclass(frozen=True)
class Inert:
    pass


@dataclass(frozen=True)
class Neutral:
    is_neutral: Callable[[Any], bool]
    reason: str
    check: Callable[[str, Any], Any] | None = None


@dataclass(frozen=True)
class Unsupported:
    reason: str


@dataclass(frozen=True)
class Custom:
    handler: str  # a _Mapper method name


INERT = Inert()


def _is_false(value) -> bool:
    return value is False


def _equals(expected) -> Callable[[Any], bool]:
    return lambda value: value == expected


def _empty(value) -> bool:
    return value in (None, "", {}, [])


def _inert(*names: str) -> dict[str, Inert]:
    return dict.fromkeys(names, INERT)


# MindIE's HTTPS fields: one path, or a list of file names under a *Path folder.
_TLS_FIELDS = ("tlsCert", "tlsPk", "tlsPkPwd", "tlsCaPath", "tlsCaFile", "tlsCrl", "tlsCrlPath", "tlsCrlFiles")
_NO_SLO_SCHEDULING = "MindIE's latency-target scheduling knobs have no counterpart (vLLM-style scheduler)"

_SERVER: dict[str, Any] = {
    "ipAddress": Flag("host", _text),
    "port": Flag("port", _port),
    "httpsEnabled": Flag("require_https", _bool),
    "allowAllZeroIpListening": Neutral(lambda v: True, "", _bool),  # only guards ipAddress 0.0.0.0
    "managementIpAddress": Unsupported("no separate management endpoint: /health and friends are on the main port"),
    "managementPort": Unsupported("no separate management endpoint: /health and friends are on the main port"),
    "metricsPort": Unsupported("no separate metrics port: /metrics is on the main port"),
    "maxLinkNum": Unsupported("no limit on concurrent connections"),
    "fullTextEnabled": Neutral(_is_false, "streams always carry the new text only", _bool),
    "inferMode": Neutral(_equals("standard"), "only standard (not disaggregated) inference"),
    "openAiSupport": Neutral(_equals("vllm"), "the OpenAI API is always vLLM-compatible"),
    "tokenTimeout": Flag("token_timeout", _positive),
    "e2eTimeout": Flag("request_timeout", _positive),
    "distDPServerEnabled": Neutral(_is_false, "no distributed data-parallel server", _bool),
    "interCommTLSEnabled": Neutral(_is_false, "no inter-process TLS", _bool),
    **{name: Custom("_tls_field") for name in _TLS_FIELDS},
    **_inert("managementTlsCaFile", "managementTlsCert", "managementTlsPk", "managementTlsPkPwd", "managementTlsCrl",
             "managementTlsCrlPath", "managementTlsCrlFiles", "kmcKsfMaster", "kmcKsfStandby", "interCommPort",
             "interCommTlsCaPath", "interCommTlsCaFile", "interCommTlsCaFiles", "interCommTlsCert", "interCommPk",
             "interCommPkPwd", "interCommTlsCrl", "interCommTlsCrlPath", "interCommTlsCrlFiles"),
}

_MODEL: dict[str, Any] = {
    "modelName": Flag("served_model_name", _text),
    "modelWeightPath": Flag("model", _text),
    "modelInstanceType": Neutral(_equals("Standard"), "only standard model instances"),
    "worldSize": Flag("tensor_parallel_size", _positive),
    "cpuMemSize": Neutral(_equals(0), "no CPU swap space for the KV cache", lambda p, v: _int(p, v, minimum=0)),
    "npuMemSize": Custom("_npu_mem_size"),
    "backendType": Neutral(_equals("atb"), "this server is an ATB backend"),
    "trustRemoteCode": Neutral(_is_false, "checkpoint code is never run", _bool),
    "plugin_params": Neutral(_empty, "MindIE plugins (speculative decoding and others) are not supported"),
}

_MODEL_DEPLOY: dict[str, Any] = {
    "maxSeqLen": Flag("max_model_len", _positive),
    "maxInputTokenLen": Flag("max_input_tokens", _positive),
    "truncation": Neutral(_is_false, "over-long inputs are refused, not truncated", _bool),
    "ModelConfig": Custom("_model_config"),
    "LoraModules": Custom("_lora_modules"),
}

_SCHEDULE: dict[str, Any] = {
    "templateType": Neutral(_equals("Standard"), "only the standard scheduling template"),
    "templateName": INERT,
    "cacheBlockSize": Flag("block_size", _positive),
    "maxBatchSize": Flag("max_num_seqs", _positive),
    "maxPrefillTokens": Flag("max_num_batched_tokens", _positive),
    "maxIterTimes": Flag("max_new_tokens", _positive),
    "maxPrefillBatchSize": Unsupported("no separate prefill batch limit: max_num_seqs bounds every step"),
    "prefillTimeMsPerReq": Unsupported(_NO_SLO_SCHEDULING),
    "prefillPolicyType": Unsupported(_NO_SLO_SCHEDULING),
    "decodeTimeMsPerReq": Unsupported(_NO_SLO_SCHEDULING),
    "decodePolicyType": Unsupported(_NO_SLO_SCHEDULING),
    "maxQueueDelayMicroseconds": Unsupported(_NO_SLO_SCHEDULING),
    "maxPreemptCount": Neutral(_equals(0), "preemption is not capped", lambda p, v: _int(p, v, minimum=0)),
    "supportSelectBatch": Neutral(_is_false, "no prefill/decode batch selection", _bool),
}

_BACKEND: dict[str, Any] = {
    "backendName": INERT,
    "npuDeviceIds": Custom("_npu_device_ids"),
    "tokenizerProcessNumber": Flag("tokenizer_workers", _positive),
    "modelInstanceNumber": Neutral(_equals(1), "one model instance per server", _positive),
    "multiNodesInferEnabled": Neutral(_is_false, "no multi-node inference", _bool),
    "interNodeTLSEnabled": Neutral(_is_false, "no multi-node inference", _bool),
    **_inert("multiNodesInferPort", "interNodeTlsCaPath", "interNodeTlsCaFile", "interNodeTlsCaFiles",
             "interNodeTlsCert", "interNodeTlsPk", "interNodeTlsPkPwd", "interNodeTlsCrl", "interNodeTlsCrlPath",
             "interNodeTlsCrlFiles", "interNodeKmcKsfMaster", "interNodeKmcKsfStandby"),
    "ModelDeployConfig": _MODEL_DEPLOY,
    "ScheduleConfig": _SCHEDULE,
}

_LOGS = "logs go to stderr; set the level with the server's --log-level"
_LOG: dict[str, Any] = {name: Unsupported(_LOGS) for name in ("logLevel", "logFileSize", "logFileNum", "logPath")}

_TOP: dict[str, Any] = {
    "Version": INERT,
    "ServerConfig": _SERVER,
    "BackendConfig": _BACKEND,
    "LogConfig": _LOG,
    "EnableDynamicAdjustTimeoutConfig": Neutral(_is_false, "no timeouts to adjust", _bool),
}


# -- the walk --------------------------------------------------------------------------------------


class _Mapper:
    def __init__(self, base_dir: Path):
        self.out = MindieMapping()
        self.base_dir = base_dir
        self.tls: dict[str, Any] = {}  # ServerConfig's TLS fields, mapped once httpsEnabled is known

    def ignore(self, path: str, reason: str) -> None:
        self.out.ignored.append(path)
        self.out.reasons[path] = reason

    def section(self, path: str, data, schema: dict[str, Any]) -> None:
        if not isinstance(data, dict):
            raise ValueError(f"{path or 'the config'} must be a JSON object, got {_type_name(data)}")
        for key, value in data.items():
            here = f"{path}.{key}" if path else key
            rule = schema.get(key)
            if rule is None:
                self.ignore(here, "unknown field")
            elif isinstance(rule, dict):
                self.section(here, value, rule)
            elif isinstance(rule, Flag):
                self.out.flags[rule.name] = rule.check(here, value)
            elif isinstance(rule, Neutral):
                if rule.check is not None:
                    rule.check(here, value)
                if not rule.is_neutral(value):
                    self.ignore(here, rule.reason)
            elif isinstance(rule, Unsupported):
                self.ignore(here, rule.reason)
            elif isinstance(rule, Custom):
                getattr(self, rule.handler)(here, value)
            # Inert: nothing to do

    def _npu_device_ids(self, path: str, value) -> None:
        if (not isinstance(value, list) or not value
                or not all(isinstance(group, list) for group in value) or not value[0]):
            raise ValueError(f"{path} must be a list of device-id lists such as [[0, 1]], got {value!r}")
        for index, group in enumerate(value):
            for position, device in enumerate(group):
                _int(f"{path}[{index}][{position}]", device, minimum=0)
            if len(set(group)) != len(group):
                raise ValueError(f"{path}[{index}] lists a device twice: {group}")
        devices = list(value[0])
        self.out.flags["devices"] = devices
        self.out.env["ASCEND_RT_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        for index in range(1, len(value)):
            self.ignore(f"{path}[{index}]", "one model instance per server: only the first device group is used")

    def _npu_mem_size(self, path: str, value) -> None:
        _int(path, value)
        if value > 0:
            self.out.flags["kv_cache_bytes"] = value * 2**30
        elif value != -1:
            raise ValueError(f"{path} must be -1 (automatic) or a size in GiB > 0, got {value}")

    def _tls_field(self, path: str, value) -> None:
        name = path.rsplit(".", 1)[-1]
        if name in ("tlsCaFile", "tlsCrlFiles"):
            files = [value] if isinstance(value, str) else value
            if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
                raise ValueError(f"{path} must be a file name or a list of file names, got {value!r}")
            self.tls[name] = files
        elif value not in (None, ""):
            self.tls[name] = _text(path, value)

    def finish_tls(self) -> None:
        """With httpsEnabled true, the certificate fields become the server's TLS settings
        (paths relative to the config file's folder); otherwise they are unused. A config that
        names certificates never ends up on plain HTTP without a note saying so."""
        tls, flags = self.tls, self.out.flags
        named = [f"ServerConfig.{name}" for name in _TLS_FIELDS if tls.get(name)]
        if "require_https" not in flags and named:
            # MindIE serves HTTPS unless httpsEnabled says false: the same config there would.
            flags["require_https"] = True
            self.out.notes.append(f"ServerConfig.httpsEnabled is absent and {', '.join(named)} "
                                  f"{'is' if len(named) == 1 else 'are'} set: serving HTTPS, MindIE's default "
                                  "(set httpsEnabled: false to serve plain HTTP)")
        if not flags.get("require_https"):
            if named:
                self.out.notes.append(f"ServerConfig.httpsEnabled is false: {', '.join(named)} "
                                      "unused, serving plain HTTP")
            return

        def path(*parts: str) -> str:
            return str(self.base_dir.joinpath(*parts))

        for field_name, flag in (("tlsCert", "ssl_certfile"), ("tlsPk", "ssl_keyfile"),
                                 ("tlsPkPwd", "ssl_keyfile_password_file")):
            if field_name in tls:
                flags[flag] = path(tls[field_name])
        if tls.get("tlsCaFile"):
            flags["ssl_ca_certs"] = [path(tls.get("tlsCaPath", ""), name) for name in tls["tlsCaFile"]]
            flags["ssl_cert_reqs"] = "required"  # MindIE's HTTPS is mutual TLS when it names a CA
        crl = [path(tls.get("tlsCrlPath", ""), name) for name in tls.get("tlsCrlFiles", [])]
        if "tlsCrl" in tls:
            crl.append(path(tls["tlsCrl"]))
        if crl:
            flags["ssl_crl"] = crl

    def _lora_modules(self, path: str, value) -> None:
        """``[{"name", "path", "baseModelName"}]`` -> enable_lora and lora_modules (paths relative
        to the config file's folder)."""
        from atb_plugin.lora.registry import LoRAModule

        if not isinstance(value, list):
            raise ValueError(f"{path} must be a list of {{\"name\", \"path\"}} objects, got {_type_name(value)}")
        modules = []
        for index, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise ValueError(f"{path}[{index}] must be an object with \"name\" and \"path\", got {entry!r}")
            modules.append(LoRAModule(_text(f"{path}[{index}].name", entry.get("name")),
                                      str(self.base_dir / _text(f"{path}[{index}].path", entry.get("path"))),
                                      entry.get("baseModelName")))
        if modules:
            self.out.flags["enable_lora"] = True
            self.out.flags["lora_modules"] = modules

    def _model_config(self, path: str, value) -> None:
        if not isinstance(value, list) or not value:
            raise ValueError(f"{path} must be a non-empty list of model objects, got {_type_name(value)}")
        self.section(f"{path}[0]", value[0], _MODEL)
        for index in range(1, len(value)):
            self.ignore(f"{path}[{index}]", "one model per server: only the first ModelConfig entry is served")


def map_mindie_config(config: Mapping[str, Any], base_dir: str | Path = ".") -> MindieMapping:
    """The mapping for an already-parsed config (see the module docstring); relative certificate
    paths are taken from ``base_dir`` (the config file's folder)."""
    mapper = _Mapper(Path(base_dir))
    mapper.section("", config, _TOP)
    mapper.finish_tls()
    flags = mapper.out.flags
    if "max_input_tokens" in flags and "max_model_len" in flags and flags["max_input_tokens"] > flags["max_model_len"]:
        raise ValueError(
            f"BackendConfig.ModelDeployConfig.maxInputTokenLen ({flags['max_input_tokens']}) must not exceed "
            f"maxSeqLen ({flags['max_model_len']})")
    return mapper.out


def load_mindie_config(path: str | Path) -> MindieMapping:
    """Read and map a MindIE ``config.json``; ``ValueError`` with the file and field at fault when
    it cannot be read, is not JSON, or has a mapped field of the wrong type or range."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read MindIE config {path}: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"MindIE config {path} is not valid JSON: {exc.msg} "
                         f"(line {exc.lineno}, column {exc.colno})") from exc
    try:
        return map_mindie_config(config, Path(path).resolve().parent)
    except ValueError as exc:
        raise ValueError(f"MindIE config {path}: {exc}") from exc
