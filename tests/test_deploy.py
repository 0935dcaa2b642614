"""The deployment files name commands and flags this package installs, and discovery lists agents that are
not ready (an agent whose NVML is down must still be pulled, to be reported)."""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path

import yaml

from gpufleet.agent import config as agent_config
from gpufleet.agent.attribution import JobAttributor
from gpufleet.agent.podresources import DEFAULT_SOCKET
from gpufleet.server import settings as server_settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _manifests() -> list[dict]:
    return [
        doc
        for path in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _parse(command: list[str]) -> None:
    """Parse a command line with the flag parser of the daemon it starts (ConfigError/SystemExit if unknown)."""
    script, *args = command
    if script == "gpufleet-agent":
        agent_config.build_parser().parse_args(args)
    else:
        assert script == "gpufleet-server" and args[0] == "serve", command
        server_settings.build_parser().parse_args(args[1:])


def test_every_container_runs_an_installed_command_with_flags_it_knows():
    containers = [
        c
        for doc in _manifests()
        if doc["kind"] in ("StatefulSet", "DaemonSet")
        for c in doc["spec"]["template"]["spec"]["containers"]
    ]
    assert {c["command"][0] for c in containers} == {"gpufleet-agent", "gpufleet-server"}
    for c in containers:
        assert c["command"][0] in SCRIPTS
        _parse(c["command"] + c.get("args", []))


def test_each_server_replica_has_its_own_alert_store(tmp_path):
    # Scaled to an HA pair, a Deployment's replicas would share one volume, and one SQLite file.
    docs = _manifests()
    (server,) = [d for d in docs if d["metadata"]["name"] == "gpufleet-server" and "template" in d.get("spec", {})]
    assert server["kind"] == "StatefulSet"
    (claim,) = server["spec"]["volumeClaimTemplates"]
    (container,) = server["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config,) = [
        d["data"]["server.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpufleet-server"
    ]
    (tmp_path / "server.yaml").write_text(config)
    settings = server_settings.load_settings(["--config.file", str(tmp_path / "server.yaml")], env={})
    assert container["args"] == ["serve", "--config.file", f"{mounts['config']}/server.yaml"]
    assert Path(settings.storage_path).parent == Path(mounts[claim["metadata"]["name"]])
    assert claim["metadata"]["name"] not in {v["name"] for v in server["spec"]["template"]["spec"]["volumes"]}


def test_the_agents_headless_service_lists_agents_that_are_not_ready():
    (svc,) = [d for d in _manifests() if d["kind"] == "Service" and d["metadata"]["name"] == "gpufleet-agent"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


def test_systemd_units_start_installed_commands_from_one_virtualenv_with_flags_they_know():
    starts = []
    for path in sorted((ROOT / "deploy" / "systemd").glob("*.service")):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str
        unit.read_string(path.read_text())
        starts.append(unit["Service"]["ExecStart"].split())
    assert len({Path(argv[0]).parent for argv in starts}) == 1
    for argv in starts:
        _parse([Path(argv[0]).name] + argv[1:])


def test_the_kubernetes_job_example_gives_its_pods_the_job_the_agent_reads(tmp_path):
    """The example's env block, expanded as the kubelet does for a pod of that job, names the job
    NAMESPACE/NAME to an agent with its default settings."""
    (job,) = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "examples" / "pytorchjob.yaml").read_text())
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    # What the operator puts on each pod it creates.
    pod = {"metadata.namespace": namespace, "metadata.labels['training.kubeflow.org/job-name']": name}
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            env: dict[str, str] = {}
            for var in container["env"]:
                if "valueFrom" in var:
                    env[var["name"]] = pod[var["valueFrom"]["fieldRef"]["fieldPath"]]
                else:  # $(VAR) refers to a variable defined earlier in the list; anything else stays as written
                    env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m, env=env: env.get(m[1], m[0]), var["value"])
            pid = tmp_path / str(len(list(tmp_path.iterdir())) + 1)
            pid.mkdir()
            (pid / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
            assert JobAttributor(tmp_path).job_for(0, "GPU-a", (int(pid.name),)) == f"{namespace}/{name}"


def test_the_annotated_agent_config_loads_and_states_the_defaults():
    path = str(ROOT / "deploy" / "agent.yaml")
    assert agent_config.load_config(["--config.file", path], environ={}) == agent_config.AgentConfig(config_file=path)


def test_the_kubernetes_config_maps_hold_settings_the_daemons_accept_commented_examples_included(tmp_path):
    """Each ConfigMap's file is loaded as the daemon would load it; a commented-out example, uncommented,
    must be a setting too (its value may name a file that only exists in the pod)."""
    maps = {doc["metadata"]["name"]: doc["data"] for doc in _manifests() if doc["kind"] == "ConfigMap"}
    (server_file,) = maps["gpufleet-server"].values()
    path = tmp_path / "server.yaml"
    path.write_text(server_file)
    assert server_settings.load_settings(["--config.file", str(path)], env={}).targets_dns
    commented = re.findall(r"^\s*# ([a-z][a-z0-9.-]*): \S", server_file, flags=re.MULTILINE)
    assert "alertmanager.basic-auth.password-file" in commented
    assert [key for key in commented if key not in server_settings.FLAGS] == []


def test_the_agents_daemonset_reaches_the_kubelets_socket_and_lists_its_nodes_pods_without_host_pids():
    """The route that serves on Kubernetes needs the socket's folder and a role to list pods; none of what
    the /proc route needed (the host's PIDs, the right to trace other users' processes)."""
    docs = _manifests()
    (agent,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "gpufleet-agent"]
    spec = agent["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not spec.get("hostPID") and container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    socket_dir = str(Path(DEFAULT_SOCKET).parent)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    (volume,) = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == socket_dir]
    assert mounts[volume["name"]]["mountPath"] == socket_dir and mounts[volume["name"]]["readOnly"] is True
    config = agent_config.load_config(container["args"], environ={})
    assert config.pod_resources_socket is None and config.pod_labels == "api-server"  # the kubelet's own socket
    assert any(a.startswith("--node=$(NODE_NAME)") for a in container["args"])  # the API server's field selector
    # The service account may list pods, and nothing else.
    account = spec["serviceAccountName"]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": agent["metadata"]["namespace"]} in d["subjects"]
    ]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == binding["roleRef"]["name"]]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account for d in docs)


def _sharded() -> list[dict]:
    return [
        doc
        for path in sorted((ROOT / "deploy" / "kubernetes" / "sharded").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _expanded(text: str, env: dict[str, str]) -> str:
    """A container's `$(VAR)` references as Kubernetes expands them."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def test_the_shards_two_replica_sets_take_index_from_the_pod_ordinal_and_agree_on_the_count(tmp_path):
    """deploy/kubernetes/sharded/servers.yaml: shard K's HA pair is pod K of each of two StatefulSets; the
    ordinal reaches `shard` through the pod-index label and the environment, with the sets' COUNT."""
    from gpufleet.server.shard import Shard

    docs = _sharded()
    sets = sorted(
        (d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].startswith("gpufleet-shard-")),
        key=lambda d: d["metadata"]["name"],
    )
    assert [s["metadata"]["name"] for s in sets] == ["gpufleet-shard-a", "gpufleet-shard-b"]
    (config,) = [
        d["data"]["server.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpufleet-shards"
    ]
    (tmp_path / "server.yaml").write_text(config)
    count = sets[0]["spec"]["replicas"]
    assert count > 1 and all(s["spec"]["replicas"] == count for s in sets)

    def without_replica(d: dict) -> str:
        return yaml.safe_dump(d["spec"]["template"]["spec"])

    assert without_replica(sets[0]) == without_replica(sets[1])
    for s in sets:
        labels = s["spec"]["template"]["metadata"]["labels"]
        assert s["spec"]["selector"]["matchLabels"].items() <= labels.items()
        (container,) = s["spec"]["template"]["spec"]["containers"]
        _parse(container["command"] + container["args"])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert container["args"] == ["serve", "--config.file", f"{mounts['config']}/server.yaml"]
        env = {e["name"]: e for e in container["env"]}
        assert (
            env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
        )
        for ordinal in (0, count - 1):
            values = {"POD_INDEX": str(ordinal)}
            environ = {k: _expanded(e["value"], values) for k, e in env.items() if "value" in e}
            settings = server_settings.load_settings(["--config.file", str(tmp_path / "server.yaml")], env=environ)
            assert settings.shard == Shard(ordinal, count)
            assert settings.prometheus_url and settings.shard_peers and not settings.targets_dns
        (claim,) = s["spec"]["volumeClaimTemplates"]
        assert Path(settings.storage_path).parent == Path(mounts[claim["metadata"]["name"]])
    (headless,) = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["selector"].items() <= sets[0]["spec"]["template"]["metadata"]["labels"].items()
    assert headless["metadata"]["name"] in settings.shard_peers[0]


def test_the_scrapers_split_the_agents_among_their_members_and_write_to_the_database_the_shards_read():
    docs = _sharded()
    (scrapers,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "vmagent-gpufleet"]
    (container,) = scrapers["spec"]["template"]["spec"]["containers"]
    flags = dict(arg.lstrip("-").split("=", 1) for arg in container["args"])
    assert int(flags["promscrape.cluster.membersCount"]) == scrapers["spec"]["replicas"]
    assert flags["promscrape.cluster.memberNum"] == "$(POD_NAME)"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]} == {
        "POD_NAME": "metadata.name"
    }
    (scrape,) = [
        d["data"]["scrape.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vmagent-gpufleet"
    ]
    (job,) = yaml.safe_load(scrape)["scrape_configs"]
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r["action"] == "keep"}
    (daemonset,) = [d for d in _manifests() if d["kind"] == "DaemonSet"]
    assert (
        keeps[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]
        == daemonset["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    )
    ports = [
        p["containerPort"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    ]
    assert int(keeps[("__meta_kubernetes_pod_container_port_number",)]) in ports
    (config,) = [
        d["data"]["server.yaml"]
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "gpufleet-shards"
    ]
    read = yaml.safe_load(config)["ingest.prometheus-url"]
    write = flags["remoteWrite.url"]
    assert read.startswith("http://vmselect.") and write.startswith("http://vminsert.")
    assert read.split("/select/")[1].split("/")[0] == write.split("/insert/")[1].split("/")[0], "one tenant"
