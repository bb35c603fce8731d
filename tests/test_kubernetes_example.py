"""examples/kubernetes/: the JobSet manifest is valid against JobSet's published CRD schema
(committed under schema/, strict about unknown fields as ``kubectl --validate=strict``), and
its failure rules map ft_launcher's exit codes to what policy.py decides for them."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import yaml

from ft_launcher import policy
from ft_launcher.cli import launch_config_from_args
from ft_launcher.policy import CycleResult, JobState, Outcome, WorkerExit

jsonschema = pytest.importorskip("jsonschema")

KUBE = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
CRD = KUBE / "schema" / "jobset.x-k8s.io_jobsets.yaml"
MANIFEST = KUBE / "jobset.yaml"
REQUEUE = {"RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
           "RestartJobAndIgnoreMaxRestarts"}
STOP = {"FailJobSet"}


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _strict(schema: dict) -> dict:
    """An object schema that lists its properties rejects others, unless it says it keeps
    unknown fields (what the API server's strict field validation does)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and \
                    not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@functools.cache
def _crd() -> dict:
    """The CRD (800 KB of YAML), parsed once per process with libyaml where PyYAML has it;
    the tests only read it."""
    return yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _schema(version: str) -> dict:
    crd = _crd()
    assert crd["spec"]["group"] == "jobset.x-k8s.io" and crd["spec"]["names"]["kind"] == "JobSet"
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert found, f"{CRD} has no version {version}"
    schema = _strict(found[0]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"jobset.x-k8s.io/{version}"]
    schema["properties"]["kind"]["enum"] = ["JobSet"]
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "spec"})
    return schema


def _validate(doc: dict) -> None:
    version = doc.get("apiVersion", "/").rpartition("/")[2]
    jsonschema.Draft7Validator(_schema(version)).validate(doc)


def test_the_manifest_is_a_valid_jobset():
    _validate(_manifest())


@pytest.mark.parametrize("path, value", [
    (("spec", "failurePolicy", "rules", 0, "action"), "RestartEverything"),
    (("spec", "replicatedJobs", 0, "template", "spec", "podFailurePolicy", "rules", 1,
      "onExitCodes", "values"), ["16"]),
    (("spec", "replicatedJobs", 0, "template", "spec", "podFailurePolicy", "rulez"), []),
    (("spec", "replicatedJobs", 0, "template", "spec", "backoffLimit"), "none"),
    (("apiVersion",), "jobset.x-k8s.io/v1"),
])
def test_the_schema_check_catches_a_broken_manifest(path, value):
    doc = _manifest()
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        _validate(doc)


def _trainer(doc: dict) -> tuple[dict, dict]:
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job, job["template"]["spec"]["containers"][0]


def _job_failure(job: dict, container: str, code: int) -> tuple[str, str]:
    """(reason, message) of the Job whose pod's container exited with ``code``, as the Job
    controller words them (a podFailurePolicy rule, else the backoff limit)."""
    for index, rule in enumerate(job.get("podFailurePolicy", {}).get("rules", [])):
        on = rule.get("onExitCodes")
        if on is None or on.get("containerName", container) != container:
            continue
        if (code in on["values"]) == (on["operator"] == "In"):
            if rule["action"] == "FailJob":
                return "PodFailurePolicy", (f"Container {container} for pod default/p failed "
                                            f"with exit code {code} matching FailJob rule at "
                                            f"index {index}")
            assert rule["action"] == "Count", f"rule {index}: {rule['action']} for {code}"
            break
    assert job["backoffLimit"] == 0  # one counted failure fails the Job
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


def _jobset_action(doc: dict, reason: str, message: str) -> str:
    for rule in doc["spec"]["failurePolicy"].get("rules", []):
        reasons = rule.get("onJobFailureReasons") or [reason]
        patterns = rule.get("onJobFailureMessagePatterns") or [""]
        if reason in reasons and any(re.search(p, message) for p in patterns):
            return rule["action"]
    return "RestartJobSet"  # JobSet's action when no rule matches


def _kube_does(code: int) -> str:
    doc = _manifest()
    job, container = _trainer(doc)
    action = _jobset_action(doc, *_job_failure(job, container["name"], code))
    assert action in REQUEUE | STOP, action
    return "requeue" if action in REQUEUE else "stop"


def _policy_requeues(code: int) -> bool:
    """What policy.decide tells a scheduler when the launcher stops with ``code``."""
    stalled = code == policy.EXIT_NO_PROGRESS
    state = JobState(max_restarts=0, num_devices=1, nproc=1, host="node-a",
                     max_no_progress_cycles=1 if stalled else None, last_iteration=5)
    worker_code = policy.EXIT_FAILURE if stalled else code
    result = CycleResult(0, Outcome.FAILED, [WorkerExit(0, 0, 123, worker_code, None)],
                         progress_iteration=5)
    decision = policy.decide(result, state)
    assert decision.exit_code == code and decision.next_action is not None
    return decision.next_action.requeue


@pytest.mark.parametrize("code", [policy.EXIT_FAILURE, policy.EXIT_RESUME_ELSEWHERE,
                                  policy.EXIT_NO_PROGRESS])
def test_an_exit_code_is_requeued_or_stopped_as_the_policy_says(code):
    assert _kube_does(code) == ("requeue" if _policy_requeues(code) else "stop")


def test_a_final_validation_failure_stops_the_job():
    """17: policy.py's verdict is final; whether to exclude a node or skip an iteration is
    in summary.json, which an exit code cannot carry, so Kubernetes stops and a person (or
    a controller reading summary.json) decides."""
    assert _kube_does(policy.EXIT_FAILED_VALIDATION) == "stop"


def test_a_preempted_pod_restarts_the_job_without_spending_its_budget():
    doc = _manifest()
    job, _ = _trainer(doc)
    rules = job["podFailurePolicy"]["rules"]
    index = next(i for i, r in enumerate(rules)
                 if {"type": "DisruptionTarget"} in r.get("onPodConditions", []))
    assert rules[index]["action"] == "FailJob"
    message = f"Pod default/p has condition DisruptionTarget matching FailJob rule at index {index}"
    assert _jobset_action(doc, "PodFailurePolicy", message) == \
        "RestartJobSetAndIgnoreMaxRestarts"


def test_the_pods_command_line_and_pet_variables_make_the_world(tmp_path, monkeypatch):
    """The container's command, with its PET_* values (the node rank as pod 1 gets it),
    parses to the world the JobSet runs: NNODES pods, each a node of the static rendezvous."""
    doc = _manifest()
    job, container = _trainer(doc)
    assert container["command"] == ["ft_launcher"]
    env = {e["name"]: e.get("value", "1") for e in container["env"]}
    assert {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
            "PET_MASTER_PORT"} <= set(env)
    script = tmp_path / "train.py"
    script.write_text("")
    args = [str(script) if a.endswith(".py") else a for a in container["args"]]
    args = [str(tmp_path / "runs") if a.startswith("/runs") else a for a in args]
    cfg = launch_config_from_args(args, env)
    assert cfg.max_nodes == cfg.min_nodes == job["parallelism"] == job["completions"]
    assert (cfg.node_rank, cfg.master_port) == (1, int(env["PET_MASTER_PORT"]))
    name = doc["metadata"]["name"]
    rjob = doc["spec"]["replicatedJobs"][0]["name"]
    assert cfg.master_addr == f"{name}-{rjob}-0-0.{name}"  # pod 0 of the JobSet's service
    port = container["ports"][0]["containerPort"]
    assert port == cfg.master_port
