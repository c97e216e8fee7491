"""MindIE config.json -> server options: mapped fields, reported fields, type errors."""

from __future__ import annotations

import copy
import json

import pytest

from atb_plugin.server.mindie_config import load_mindie_config, map_mindie_config

# A MindIE 1.0 / 2.x single-node config.json as shipped (field names from MindIE's docs), with
# the values a deployment typically edits.
SAMPLE = {
    "Version": "1.0.0",
    "LogConfig": {"logLevel": "Info", "logFileSize": 20, "logFileNum": 20, "logPath": "logs/mindie-server.log"},
    "ServerConfig": {
        "ipAddress": "192.168.0.24",
        "managementIpAddress": "127.0.0.2",
        "port": 1025,
        "managementPort": 1026,
        "metricsPort": 1027,
        "allowAllZeroIpListening": False,
        "maxLinkNum": 1000,
        "httpsEnabled": False,
        "fullTextEnabled": False,
        "tlsCaPath": "security/ca/",
        "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem",
        "tlsPk": "security/keys/server.key.pem",
        "tlsPkPwd": "security/pass/key_pwd.txt",
        "tlsCrlPath": "security/certs/",
        "tlsCrlFiles": ["server_crl.pem"],
        "kmcKsfMaster": "tools/pmt/master/ksfa",
        "kmcKsfStandby": "tools/pmt/standby/ksfb",
        "inferMode": "standard",
        "interCommTLSEnabled": False,
        "interCommPort": 1121,
        "openAiSupport": "vllm",
        "tokenTimeout": 600,
        "e2eTimeout": 600,
        "distDPServerEnabled": False,
    },
    "BackendConfig": {
        "backendName": "mindieservice_llm_engine",
        "modelInstanceNumber": 1,
        "npuDeviceIds": [[0, 1]],
        "tokenizerProcessNumber": 8,
        "multiNodesInferEnabled": False,
        "multiNodesInferPort": 1120,
        "interNodeTLSEnabled": False,
        "interNodeTlsCaPath": "security/grpc/ca/",
        "ModelDeployConfig": {
            "maxSeqLen": 2560,
            "maxInputTokenLen": 2048,
            "truncation": False,
            "ModelConfig": [
                {
                    "modelInstanceType": "Standard",
                    "modelName": "qwen2-vl",
                    "modelWeightPath": "/data/Qwen2-VL-7B-Instruct",
                    "worldSize": 1,
                    "cpuMemSize": 0,
                    "npuMemSize": -1,
                    "backendType": "atb",
                    "trustRemoteCode": False,
                }
            ],
        },
        "ScheduleConfig": {
            "templateType": "Standard",
            "templateName": "Standard_LLM",
            "cacheBlockSize": 128,
            "maxPrefillBatchSize": 50,
            "maxPrefillTokens": 8192,
            "prefillTimeMsPerReq": 150,
            "prefillPolicyType": 0,
            "decodeTimeMsPerReq": 50,
            "decodePolicyType": 0,
            "maxBatchSize": 200,
            "maxIterTimes": 512,
            "maxPreemptCount": 0,
            "supportSelectBatch": False,
            "maxQueueDelayMicroseconds": 5000,
        },
    },
}


def write(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config, indent=4), encoding="utf-8")
    return path


def test_sample_file_maps_onto_flags(tmp_path):
    mapping = load_mindie_config(write(tmp_path, SAMPLE))
    assert mapping.flags == {
        "host": "192.168.0.24",
        "port": 1025,
        "devices": [0, 1],
        "tokenizer_workers": 8,
        "max_model_len": 2560,
        "max_input_tokens": 2048,
        "served_model_name": "qwen2-vl",
        "model": "/data/Qwen2-VL-7B-Instruct",
        "tensor_parallel_size": 1,
        "block_size": 128,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 200,
        "max_new_tokens": 512,
        "require_https": False,
        "request_timeout": 600,
        "token_timeout": 600,
    }
    assert mapping.env == {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}


def test_sample_file_reports_what_has_no_effect_here(tmp_path):
    mapping = load_mindie_config(write(tmp_path, SAMPLE))
    assert mapping.ignored == [
        "LogConfig.logLevel",
        "LogConfig.logFileSize",
        "LogConfig.logFileNum",
        "LogConfig.logPath",
        "ServerConfig.managementIpAddress",
        "ServerConfig.managementPort",
        "ServerConfig.metricsPort",
        "ServerConfig.maxLinkNum",
        "BackendConfig.ScheduleConfig.maxPrefillBatchSize",
        "BackendConfig.ScheduleConfig.prefillTimeMsPerReq",
        "BackendConfig.ScheduleConfig.prefillPolicyType",
        "BackendConfig.ScheduleConfig.decodeTimeMsPerReq",
        "BackendConfig.ScheduleConfig.decodePolicyType",
        "BackendConfig.ScheduleConfig.maxQueueDelayMicroseconds",
    ]
    assert set(mapping.reasons) == set(mapping.ignored)
    assert "/metrics" in mapping.reasons["ServerConfig.metricsPort"]
    # Neutral values and certificate paths are silent.
    for quiet in ("ServerConfig.httpsEnabled", "ServerConfig.tlsCert", "BackendConfig.ModelDeployConfig.truncation",
                  "BackendConfig.ModelDeployConfig.ModelConfig[0].worldSize", "Version"):
        assert quiet not in mapping.ignored


def test_non_neutral_and_unknown_fields_are_reported():
    config = copy.deepcopy(SAMPLE)
    config["ServerConfig"]["httpsEnabled"] = True
    config["ServerConfig"]["someNewSwitch"] = 1
    deploy = config["BackendConfig"]["ModelDeployConfig"]
    deploy["truncation"] = True
    model = deploy["ModelConfig"][0]
    model.update(worldSize=2, trustRemoteCode=True, npuMemSize=8, async_scheduler_wait_time=120)
    deploy["ModelConfig"].append({"modelName": "second", "modelWeightPath": "/data/other"})
    config["BackendConfig"]["npuDeviceIds"] = [[0, 1], [2, 3]]
    mapping = map_mindie_config(config, "/etc/mindie")
    for path in ("ServerConfig.someNewSwitch",
                 "BackendConfig.ModelDeployConfig.truncation",
                 "BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode",
                 "BackendConfig.ModelDeployConfig.ModelConfig[0].async_scheduler_wait_time",
                 "BackendConfig.ModelDeployConfig.ModelConfig[1]",
                 "BackendConfig.npuDeviceIds[1]"):
        assert path in mapping.ignored, path
    assert mapping.reasons["ServerConfig.someNewSwitch"] == "unknown field"
    # httpsEnabled: the certificate fields become the server's TLS settings, relative to the
    # config's folder; a CA means mutual TLS, as in MindIE.
    assert "ServerConfig.httpsEnabled" not in mapping.ignored
    assert {key: mapping.flags[key] for key in mapping.flags if key.startswith(("ssl", "require"))} == {
        "require_https": True,
        "ssl_certfile": "/etc/mindie/security/certs/server.pem",
        "ssl_keyfile": "/etc/mindie/security/keys/server.key.pem",
        "ssl_keyfile_password_file": "/etc/mindie/security/pass/key_pwd.txt",
        "ssl_ca_certs": ["/etc/mindie/security/ca/ca.pem"],
        "ssl_cert_reqs": "required",
        "ssl_crl": ["/etc/mindie/security/certs/server_crl.pem"],
    }
    assert mapping.flags["served_model_name"] == "qwen2-vl"  # the first model only
    assert mapping.flags["devices"] == [0, 1]
    assert mapping.flags["tensor_parallel_size"] == 2  # worldSize: ranks on the npuDeviceIds devices
    assert mapping.flags["kv_cache_bytes"] == 8 * 2**30


def test_partial_config_maps_what_is_there():
    mapping = map_mindie_config({"ServerConfig": {"port": 8000}})
    assert mapping.flags == {"port": 8000}
    assert mapping.ignored == [] and mapping.env == {}


@pytest.mark.parametrize("section, key, value, message", [
    ("ServerConfig", "port", "1025", "ServerConfig.port must be an integer, got str '1025'"),
    ("ServerConfig", "port", True, "ServerConfig.port must be an integer"),
    ("ServerConfig", "port", 70000, "ServerConfig.port must be in [1, 65535], got 70000"),
    ("ServerConfig", "ipAddress", 127, "ServerConfig.ipAddress must be a non-empty string"),
    ("ServerConfig", "httpsEnabled", "false", "ServerConfig.httpsEnabled must be true or false"),
    ("BackendConfig", "npuDeviceIds", [0, 1], "BackendConfig.npuDeviceIds must be a list of device-id lists"),
    ("BackendConfig", "npuDeviceIds", [[0, -1]], "BackendConfig.npuDeviceIds[0][1] must be >= 0"),
    ("BackendConfig", "npuDeviceIds", [[0, 0]], "lists a device twice"),
    ("BackendConfig", "ScheduleConfig", [], "BackendConfig.ScheduleConfig must be a JSON object, got list"),
])
def test_wrong_types_are_named(tmp_path, section, key, value, message):
    config = copy.deepcopy(SAMPLE)
    config[section][key] = value
    with pytest.raises(ValueError, match="MindIE config .*config.json: ") as info:
        load_mindie_config(write(tmp_path, config))
    assert message in str(info.value)


@pytest.mark.parametrize("key, value, message", [
    ("maxSeqLen", 0, "BackendConfig.ModelDeployConfig.maxSeqLen must be >= 1, got 0"),
    ("maxSeqLen", 2560.5, "maxSeqLen must be an integer"),
    ("maxInputTokenLen", 4096, "maxInputTokenLen (4096) must not exceed maxSeqLen (2560)"),
    ("ModelConfig", {}, "ModelConfig must be a non-empty list"),
])
def test_model_deploy_errors(key, value, message):
    config = copy.deepcopy(SAMPLE)
    config["BackendConfig"]["ModelDeployConfig"][key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        map_mindie_config(config)


def test_model_fields_are_checked():
    config = copy.deepcopy(SAMPLE)
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = ""
    with pytest.raises(ValueError, match=r"ModelConfig\[0\]\.modelWeightPath must be a non-empty string"):
        map_mindie_config(config)
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(modelWeightPath="/m", npuMemSize=0)
    with pytest.raises(ValueError, match=r"npuMemSize must be -1 \(automatic\) or a size in GiB > 0"):
        map_mindie_config(config)


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read MindIE config"):
        load_mindie_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"ServerConfig": {"port": 1025,}}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"is not valid JSON: .*line 1"):
        load_mindie_config(bad)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="the config must be a JSON object, got list"):
        load_mindie_config(top)


def test_tls_fields_without_https_enabled_mean_https_as_in_mindie():
    """MindIE's httpsEnabled defaults to true (issue 45, item 3): certificates named without it
    are served, with a note saying why; never plain HTTP in silence."""
    server = {key: value for key, value in SAMPLE["ServerConfig"].items() if key != "httpsEnabled"}
    mapping = map_mindie_config({"ServerConfig": server}, "/etc/mindie")
    assert mapping.flags["require_https"] is True
    assert mapping.flags["ssl_certfile"] == "/etc/mindie/security/certs/server.pem"
    assert mapping.flags["ssl_keyfile_password_file"] == "/etc/mindie/security/pass/key_pwd.txt"
    assert mapping.flags["ssl_ca_certs"] == ["/etc/mindie/security/ca/ca.pem"]
    (note,) = mapping.notes
    assert "httpsEnabled is absent" in note and "ServerConfig.tlsCert" in note and "serving HTTPS" in note
    # Only a CA named: still HTTPS, so the start-up check refuses it for want of tlsCert / tlsPk.
    only_ca = map_mindie_config({"ServerConfig": {"tlsCaPath": "ca/", "tlsCaFile": ["ca.pem"]}})
    assert only_ca.flags["require_https"] is True and "ssl_certfile" not in only_ca.flags
    # httpsEnabled false: the certificates are unused, and the note says so.
    plain = map_mindie_config(SAMPLE)
    assert plain.flags["require_https"] is False and "ssl_certfile" not in plain.flags
    assert plain.notes == [f"ServerConfig.httpsEnabled is false: {', '.join(NAMED_TLS)} unused, serving plain HTTP"]
    # No TLS field at all: nothing changes.
    assert map_mindie_config({"ServerConfig": {"port": 8000}}).notes == []


NAMED_TLS = ["ServerConfig.tlsCert", "ServerConfig.tlsPk", "ServerConfig.tlsPkPwd", "ServerConfig.tlsCaPath",
             "ServerConfig.tlsCaFile", "ServerConfig.tlsCrlPath", "ServerConfig.tlsCrlFiles"]
