"""deploy/k8s/stalwart-jobset.yaml, checked as far as this machine can without a cluster:
every core object against Kubernetes' own OpenAPI schemas (strict: an unknown field is
an error), the JobSet's Job template as a batch/v1 Job, the JobSet envelope against the
fields of jobset.x-k8s.io/v1alpha2 it uses, the trainer's arguments through stalwart's
own `run` parser, and the exit-code mapping run for real through the pod's shell line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _load import scaled

from stalwart.cli.main import build_parser
from stalwart.cli.run import EXIT_NOT_ADMITTED

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "stalwart-jobset.yaml"
K8S = "1.37.0"

# The JobSet fields the manifest uses (sigs.k8s.io/jobset api/jobset/v1alpha2): a typo
# in any of them is an error here, as the API server's structural schema would make it.
JOBSET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["replicatedJobs"],
            "properties": {
                "failurePolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"maxRestarts": {"type": "integer", "minimum": 0}},
                },
                "network": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"enableDNSHostnames": {"type": "boolean"}},
                },
                "replicatedJobs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "template"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*)$"},
                            "replicas": {"type": "integer", "minimum": 1},
                            "template": {
                                "type": "object",
                                "required": ["spec"],
                                "properties": {"spec": {"type": "object"}},
                            },
                        },
                    },
                },
            },
        },
    },
}


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _jobset() -> dict[str, Any]:
    return next(d for d in _docs() if d["kind"] == "JobSet")


def _job_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _jobset()["spec"]["replicatedJobs"][0]["template"]["spec"]
    return spec


def _trainer() -> dict[str, Any]:
    containers = _job_spec()["template"]["spec"]["containers"]
    return dict(next(c for c in containers if c["name"] == "trainer"))


def test_the_core_objects_validate_against_the_kubernetes_schemas() -> None:
    core = [d for d in _docs() if d["kind"] != "JobSet"]
    kinds = {"Service", "StatefulSet", "PersistentVolumeClaim", "NetworkPolicy"}
    assert {d["kind"] for d in core} == kinds
    for doc in core:
        kv.validate(doc, K8S, strict=True)


def test_the_jobsets_job_template_is_a_valid_indexed_job() -> None:
    jobset = _jobset()
    jsonschema.validate(jobset, JOBSET_SCHEMA)
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": replicated["name"]},
            "spec": replicated["template"]["spec"],
        }
        kv.validate(job, K8S, strict=True)
    spec = _job_spec()
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it


def test_a_typo_is_caught_by_the_strict_schemas() -> None:
    service = next(d for d in _docs() if d["kind"] == "Service")
    service = {**service, "spec": {**service["spec"], "clusterIp": "None"}}
    with pytest.raises(kv.ValidationError, match="clusterIp"):
        kv.validate(service, K8S, strict=True)
    jobset = _jobset()
    jobset = {**jobset, "spec": {**jobset["spec"], "failurePolcy": {"maxRestarts": 3}}}
    with pytest.raises(jsonschema.ValidationError, match="failurePolcy"):
        jsonschema.validate(jobset, JOBSET_SCHEMA)


def _args() -> list[str]:
    """The trainer's arguments with the pod's $(VAR) references filled in."""
    values = {"NODE_RANK": "1", "JOB_ID": "gpt-train", "POD_IP": "10.0.0.7"}
    declared = {e["name"] for e in _trainer()["env"]}
    out = []
    for arg in _trainer()["args"]:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in declared, f"$({name}) is not in the container's env"
            arg = arg.replace(f"$({name})", values[name])
        out.append(arg)
    return out


def test_the_trainer_arguments_are_a_valid_stalwart_run() -> None:
    args = build_parser().parse_args(["run", *_args()])
    assert args.nnodes == "2:4" and args.node_rank == 1
    assert args.rdzv == "etcds://stalwart-etcd:2379/gpt-train"
    assert args.rdzv_tls_ca and args.rdzv_tls_cert and args.rdzv_tls_key
    assert args.rdzv_user and args.rdzv_password_file and args.token_file
    etcd = next(d for d in _docs() if d["kind"] == "Service")
    assert etcd["metadata"]["name"] == "stalwart-etcd"
    assert 2379 in [p["port"] for p in etcd["spec"]["ports"]]
    assert args.health_host == args.metrics_host == args.replica_host  # the pod IP
    trainer = _trainer()
    ports = {p["name"]: p["containerPort"] for p in trainer["ports"]}
    assert ports["health"] == args.health_port and ports["metrics"] == args.metrics_port
    assert trainer["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert trainer["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert trainer["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert "/dev/shm" in mounts and args.run_dir.startswith("/runs/")


def test_the_failure_policy_follows_stalwarts_exit_codes() -> None:
    rules = _job_spec()["podFailurePolicy"]["rules"]
    by_code = {
        code: rule["action"]
        for rule in rules
        if "onExitCodes" in rule
        for code in rule["onExitCodes"]["values"]
    }
    assert by_code == {1: "FailJob", 2: "FailJob", 3: "Ignore"}
    assert EXIT_NOT_ADMITTED not in by_code  # the shell line turns it into a success
    conditions = [c["type"] for r in rules for c in r.get("onPodConditions", [])]
    assert conditions == ["DisruptionTarget"]


@pytest.mark.parametrize("code,expected", [(0, 0), (1, 1), (2, 2), (3, 3), (4, 0), (143, 143)])
def test_the_pods_shell_line_maps_not_admitted_to_done(
    tmp_path: Path, code: int, expected: int
) -> None:
    fake = tmp_path / "stalwart"
    fake.write_text(f'#!/bin/sh\n[ "$1" = run ] && [ "$2" = --x ] || exit 99\nexit {code}\n')
    fake.chmod(0o755)
    command = _trainer()["command"]
    assert command[:2] == ["sh", "-c"]
    done = subprocess.run(
        [*command, "--x"],
        env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        timeout=scaled(30),
        check=False,
    )
    assert done.returncode == expected


def test_etcd_speaks_tls_to_certified_clients_and_only_the_job_reaches_it() -> None:
    etcd = next(d for d in _docs() if d["kind"] == "StatefulSet")
    argv = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv[1:])
    assert all(u.startswith("https://") for u in flags["--listen-client-urls"].split(","))
    assert "--client-cert-auth" in flags and flags["--trusted-ca-file"]
    assert not any("0.0.0.0" in a for a in argv)
    policies = {d["metadata"]["name"]: d for d in _docs() if d["kind"] == "NetworkPolicy"}
    etcd_in = policies["stalwart-etcd"]["spec"]["ingress"]
    sources = [f["podSelector"]["matchLabels"] for rule in etcd_in for f in rule["from"]]
    assert sources == [{"app": "stalwart-trainer"}, {"app": "stalwart-etcd"}]
    pod_labels = _job_spec()["template"]["metadata"]["labels"]
    assert policies["stalwart-trainer"]["spec"]["podSelector"]["matchLabels"] == pod_labels
