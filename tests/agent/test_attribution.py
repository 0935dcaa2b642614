"""Job attribution from a fixture procfs (environ, cgroup, unreadable entries) and a mapping directory."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import threading
from pathlib import Path

import pytest

from gpufleet.agent.attribution import (
    MAX_CONTAINER_FILE_BYTES,
    BackgroundAttributor,
    JobAttributor,
    NotRegularFile,
    Pod,
    read_in_root,
    read_regular,
)


def proc(root, pid, environ: bytes | None = None, cgroup: str | None = None):
    d = root / str(pid)
    d.mkdir()
    if environ is not None:
        (d / "environ").write_bytes(environ)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    return d


def test_environ_slurm_job_id(tmp_path):
    proc(tmp_path, 10, b"PATH=/bin\0SLURM_JOB_ID=4242\0SLURM_STEP_ID=0\0")
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (10,)) == "4242"


def test_cgroup_v1_and_v2_paths(tmp_path):
    proc(tmp_path, 11, b"PATH=/bin\0", "4:memory:/slurm/uid_1000/job_777/step_0/task_0\n")
    proc(tmp_path, 12, None, "0::/system.slice/slurmstepd.scope/job_888/step_batch/user/task_0\n")
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (11,)) == "777"
    assert att.job_for(1, "GPU-b", (12,)) == "888"


# A Kubernetes training container (cgroup v2, systemd driver) as the kubelet starts it.
POD_CGROUP = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3f1c2e4a_9b7d_4c1e_8a2f_"
    "6d5e4c3b2a19.slice/cri-containerd-5b0e1c.scope\n"
)


def test_a_kubernetes_pod_names_its_job_by_gpufleet_job(tmp_path):
    proc(
        tmp_path,
        14,
        b"HOSTNAME=llama-worker-3\0KUBERNETES_SERVICE_HOST=10.96.0.1\0GPUFLEET_JOB=research/llama-70b\0RANK=24\0",
        POD_CGROUP,
    )
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (14,)) == "research/llama-70b"


def test_a_kubernetes_pod_without_the_variable_has_no_job_rather_than_its_pod(tmp_path):
    # A pod is one node's share of a job: as a "job" it would split every multi-node job per node.
    proc(tmp_path, 15, b"HOSTNAME=llama-worker-3\0KUBERNETES_SERVICE_HOST=10.96.0.1\0RANK=24\0", POD_CGROUP)
    assert JobAttributor(tmp_path).job_for(0, "GPU-a", (15,)) is None


def pod(root, pid, environ: bytes, namespace: str | None, hostname: bytes = b"p"):
    d = proc(root, pid, b"HOSTNAME=" + hostname + b"\0KUBERNETES_SERVICE_HOST=10.96.0.1\0" + environ, POD_CGROUP)
    if namespace is not None:
        (d / "root" / "etc").mkdir(parents=True)
        (d / "root" / "etc" / "resolv.conf").write_text(
            f"# written by the kubelet\nnameserver 10.96.0.10\nsearch {namespace}.svc.cluster.local "
            "svc.cluster.local cluster.local\noptions ndots:5\n"
        )
    return d


def test_a_pytorch_job_without_the_variable_is_named_by_its_rendezvous_in_its_namespace(tmp_path):
    # The Kubeflow training operator gives every pod of a PyTorchJob MASTER_ADDR=<job>-master-0: the same on
    # every node, different between jobs, and between namespaces once completed as the pod's resolver does.
    for pid, rank in ((20, 8), (21, 9)):
        pod(tmp_path, pid, b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0RANK=%d\0" % rank, "research")
    pod(tmp_path, 22, b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0RANK=8\0", "vision")
    att = JobAttributor(tmp_path, node="gpu-07")
    assert (
        att.job_for(0, "GPU-a", (20,))
        == att.job_for(1, "GPU-b", (21,))
        == "llama-master-0.research.svc.cluster.local:23456"
    )
    assert att.job_for(2, "GPU-c", (22,)) == "llama-master-0.vision.svc.cluster.local:23456"
    assert JobAttributor(tmp_path, rendezvous=False).job_for(0, "GPU-a", (20,)) is None


def test_a_rendezvous_yields_to_a_job_variable_and_a_slurm_cgroup(tmp_path):
    pod(tmp_path, 23, b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0GPUFLEET_JOB=research/llama\0", "research")
    proc(
        tmp_path, 24, b"MASTER_ADDR=node017\0MASTER_PORT=29500\0", "0::/system.slice/slurmstepd.scope/job_4242/step_0\n"
    )
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (23,)) == "research/llama"
    assert att.job_for(1, "GPU-b", (24,)) == "4242"


@pytest.mark.parametrize(
    "environ, namespace, job",
    [
        # Host networking or an IP: the address is already unique.
        (b"MASTER_ADDR=10.1.4.17\0MASTER_PORT=29500\0", "research", "10.1.4.17:29500"),
        (b"MASTER_ADDR=dgx-03.cluster.example\0MASTER_PORT=29500\0", "research", "dgx-03.cluster.example:29500"),
        (b"MASTER_ADDR=[fd00::7]\0MASTER_PORT=29500\0", None, "fd00::7:29500"),
        # A short name with no resolv.conf to complete it stays as it is.
        (b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0", None, "llama-master-0:23456"),
        # One pod's job on loopback: put under the pod, or every pod's on every node would be one job.
        (b"MASTER_ADDR=localhost\0MASTER_PORT=29500\0", "research", "research/p/localhost:29500"),
        # ... under the node where the pod cannot be told (host networking: the node's loopback).
        (b"MASTER_ADDR=127.0.0.1\0MASTER_PORT=29501\0", None, "gpu-07/127.0.0.1:29501"),
        # A process alone in its job shares a rendezvous with nobody (a template's leftover variables).
        (b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0WORLD_SIZE=1\0", "research", None),
        (
            b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0WORLD_SIZE=16\0",
            "research",
            "llama-master-0.research.svc.cluster.local:23456",
        ),
        # Multi-host JAX.
        (b"JAX_COORDINATOR_ADDRESS=jax-trainer-0.jax-trainer:1234\0", "research", "jax-trainer-0.jax-trainer:1234"),
        (b"JAX_COORDINATOR_ADDRESS=coord:1234\0", "ml", "coord.ml.svc.cluster.local:1234"),
        # Half a rendezvous, or nonsense, names nothing.
        (b"MASTER_ADDR=llama-master-0\0", "research", None),
        (b"MASTER_PORT=29500\0", "research", None),
        (b"MASTER_ADDR=llama-master-0\0MASTER_PORT=99999\0", "research", None),
        (b"MASTER_ADDR=bad host\0MASTER_PORT=1\0", "research", None),
        (b"JAX_COORDINATOR_ADDRESS=nocolon\0", "research", None),
    ],
)
def test_rendezvous_forms(tmp_path, environ, namespace, job):
    pod(tmp_path, 25, environ, namespace)
    assert JobAttributor(tmp_path, node="gpu-07").job_for(0, "GPU-a", (25,)) == job


def test_the_first_listed_variable_that_holds_a_job_id_wins(tmp_path):
    proc(tmp_path, 16, b"SLURM_JOB_ID=4242\0GPUFLEET_JOB=team/run\0")
    proc(tmp_path, 17, b"TEAM_JOB=not a job id\0SLURM_JOB_ID=4243\0")
    proc(tmp_path, 18, b"TEAM_JOB=first\0TEAM_JOB=second\0")
    assert JobAttributor(tmp_path).job_for(0, "GPU-a", (16,)) == "4242"  # default order: Slurm first
    custom = JobAttributor(tmp_path, env_vars=("GPUFLEET_JOB", "SLURM_JOB_ID"))
    assert custom.job_for(0, "GPU-a", (16,)) == "team/run"
    fallthrough = JobAttributor(tmp_path, env_vars=("TEAM_JOB", "SLURM_JOB_ID"))
    assert fallthrough.job_for(1, "GPU-b", (17,)) == "4243"  # an invalid value is skipped, not exported
    assert fallthrough.job_for(2, "GPU-c", (18,)) == "first"  # getenv(3) reads the first of duplicates


def test_a_variable_left_out_of_the_list_is_not_read(tmp_path):
    proc(tmp_path, 19, b"SLURM_JOB_ID=4242\0", POD_CGROUP)
    proc(tmp_path, 23, b"SLURM_JOB_ID=4242\0", "0::/system.slice/slurmstepd.scope/job_4242/step_0\n")
    att = JobAttributor(tmp_path, env_vars=("GPUFLEET_JOB",))
    assert att.job_for(0, "GPU-a", (19,)) is None
    assert att.job_for(1, "GPU-b", (23,)) == "4242"  # a Slurm cgroup still names its job


def test_no_job_anywhere_is_none(tmp_path):
    proc(tmp_path, 13, b"PATH=/bin\0", "0::/user.slice/user-1000.slice/session-2.scope\n")
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (13,)) is None
    assert att.job_for(0, "GPU-a", ()) is None


def test_majority_job_wins_ties_go_to_newest(tmp_path):
    for pid, job in ((20, b"100"), (21, b"100"), (22, b"205")):
        proc(tmp_path, pid, b"SLURM_JOB_ID=" + job + b"\0")
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (20, 21, 22)) == "100"
    assert att.job_for(0, "GPU-a", (20, 22)) == "205"


def test_exited_process_is_quietly_absent(tmp_path, caplog):
    att = JobAttributor(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert att.job_for(0, "GPU-a", (99999,)) is None
    assert not caplog.records and not att.errors


def test_unreadable_environ_warns_once_and_falls_back_to_cgroup(tmp_path, caplog, monkeypatch):
    for pid in (30, 31):
        d = proc(tmp_path, pid, b"SLURM_JOB_ID=1\0", f"0::/slurmstepd.scope/job_{pid}/step_0\n")
        (d / "environ").chmod(0)
    if os.geteuid() == 0:
        # root reads mode-0 files anyway; make environ fail the way it does for an unprivileged agent.
        real_open = os.open

        def denying_open(path, *args, **kwargs):
            if str(path).endswith("environ"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", denying_open)
    att = JobAttributor(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert att.job_for(0, "GPU-a", (30,)) == "30"
        assert att.job_for(1, "GPU-b", (31,)) == "31"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].cause == "environ:EACCES"
    assert att.errors["environ:EACCES"] == 2


def test_unreadable_entry_that_is_a_directory_is_a_warning_not_a_crash(tmp_path, caplog):
    d = tmp_path / "40"
    d.mkdir()
    (d / "environ").mkdir()  # reading it raises IsADirectoryError
    with caplog.at_level(logging.WARNING):
        assert JobAttributor(tmp_path).job_for(0, "GPU-a", (40,)) is None
    assert any(r.levelname == "WARNING" for r in caplog.records)


def test_missing_procfs_root_warns(tmp_path, caplog):
    att = JobAttributor(tmp_path / "nope")
    with caplog.at_level(logging.WARNING):
        assert att.job_for(0, "GPU-a", (1,)) is None
    assert att.errors["procfs:ENOENT"] >= 1


def test_cache_per_pid_is_evicted_when_the_pid_is_gone(tmp_path):
    d = proc(tmp_path, 50, b"SLURM_JOB_ID=1\0")
    att = JobAttributor(tmp_path)
    assert att.job_for(0, "GPU-a", (50,)) == "1"
    att.end_cycle()
    (d / "environ").write_bytes(b"SLURM_JOB_ID=2\0")
    assert att.job_for(0, "GPU-a", (50,)) == "1"  # cached while the pid lives
    att.end_cycle()
    att.end_cycle()  # a cycle without pid 50: forgotten (its number may be reused)
    assert att.job_for(0, "GPU-a", (50,)) == "2"


def test_mapping_dir_wins_and_takes_the_last_listed_job(tmp_path):
    procfs = tmp_path / "proc"
    procfs.mkdir()
    proc(procfs, 60, b"SLURM_JOB_ID=1\0")
    mapping = tmp_path / "map"
    mapping.mkdir()
    (mapping / "0").write_text("311\n\n312\n")
    (mapping / "GPU-b").write_text("999\n")
    (mapping / "2").write_text("not a job id!\n")
    att = JobAttributor(procfs, mapping)
    assert att.uses_mapping_dir
    assert att.job_for(0, "GPU-a", (60,)) == "312"
    assert att.job_for(1, "GPU-b", ()) == "999"  # files named by UUID work too
    assert att.job_for(2, "GPU-c", ()) is None
    assert att.job_for(3, "GPU-d", (60,)) is None  # no file: idle GPU, procfs not consulted


def test_missing_mapping_dir_warns_once(tmp_path, caplog):
    att = JobAttributor(tmp_path, tmp_path / "absent")
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            assert att.job_for(i, f"GPU-{i}", ()) is None
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    assert att.errors["mapping:ENOENT"] == 5


def test_a_pod_process_names_its_pod_and_namespace(tmp_path):
    d = pod(tmp_path, 30, b"RANK=3\0", "research", hostname=b"llama-worker-3")
    assert JobAttributor(tmp_path, node="gpu-07").pod_for((30,)) == Pod("research", "llama-worker-3")
    # The pod's service account knows its namespace for certain; the resolver's search list is the fallback.
    account = d / "root" / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
    account.mkdir(parents=True)
    (account / "namespace").write_text("vision")
    att = JobAttributor(tmp_path, node="gpu-07")
    assert att.pod_for((30,)) == Pod("vision", "llama-worker-3")
    assert att.job_for(0, "GPU-a", (30,)) is None  # a pod is not a job
    assert JobAttributor(tmp_path, mapping_dir=tmp_path / "none").pod_for((30,)) is None


@pytest.mark.parametrize(
    "environ, cgroup, namespace, hostname",
    [
        # Not in a pod: a Slurm task with the same variables.
        (b"HOSTNAME=llama-worker-3\0", "0::/system.slice/slurmstepd.scope/job_1/step_0\n", "research", None),
        # Host networking: the pod's hostname is the node's, bare or qualified.
        (b"", POD_CGROUP, "research", b"gpu-07"),
        (b"", POD_CGROUP, "research", b"GPU-07.cluster.example"),
        # No namespace to be found, or names that are not Kubernetes names.
        (b"", POD_CGROUP, None, b"llama-worker-3"),
        (b"", POD_CGROUP, "research", b"Not_A_Pod"),
    ],
)
def test_no_pod_where_it_cannot_be_told(tmp_path, environ, cgroup, namespace, hostname):
    if hostname is None:
        d = proc(tmp_path, 33, environ, cgroup)
        (d / "root" / "etc").mkdir(parents=True)
        (d / "root" / "etc" / "resolv.conf").write_text(f"search {namespace}.svc.cluster.local\n")
    else:
        pod(tmp_path, 33, environ, namespace, hostname=hostname)
    assert JobAttributor(tmp_path, node="gpu-07").pod_for((33,)) is None


def test_a_one_node_job_on_loopback_is_its_nodes_outside_a_pod(tmp_path):
    proc(tmp_path, 34, b"MASTER_ADDR=localhost\0MASTER_PORT=29500\0WORLD_SIZE=8\0", "0::/user.slice/session-2.scope\n")
    assert JobAttributor(tmp_path, node="gpu-07").job_for(0, "GPU-a", (34,)) == "gpu-07/localhost:29500"


@pytest.fixture()
def sleeper():
    """A real process with a training rank's rendezvous in its environment."""
    procs = []

    def start(**env):
        proc = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ.get("PATH", "/bin"), **env})
        procs.append(proc)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _search_domain() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("search", "domain"):
                return words[1].strip(".").lower()
    return None


def test_a_real_process_is_named_by_its_rendezvous_through_the_real_procfs(sleeper):
    if b"kubepods" in Path("/proc/self/cgroup").read_bytes():
        pytest.skip("runs inside a Kubernetes pod: the loopback's scope there is the pod, not the node")
    remote = sleeper(MASTER_ADDR="trainer-0", MASTER_PORT="29500", WORLD_SIZE="16")
    local = sleeper(MASTER_ADDR="localhost", MASTER_PORT="29501", WORLD_SIZE="8")
    alone = sleeper(MASTER_ADDR="localhost", MASTER_PORT="29502", WORLD_SIZE="1")
    att = JobAttributor("/proc", node="gpu-07")
    domain = _search_domain()
    assert att.job_for(0, "GPU-a", (remote,)) == (f"trainer-0.{domain}:29500" if domain else "trainer-0:29500")
    assert att.job_for(1, "GPU-b", (local,)) == "gpu-07/localhost:29501"
    assert att.job_for(2, "GPU-c", (alone,)) is None
    assert att.pod_for((remote, local)) is None and not att.errors


# --- files inside containers: regular files only, never blocking, never outside the container's root --------


def bounded(call, timeout: float = 10.0):
    """Run call on a thread; fail (rather than hang the suite) if it blocks."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "blocked"
    return result[0]


def account_dir(d: Path) -> Path:
    account = d / "root" / "var" / "run" / "secrets" / "kubernetes.io" / "serviceaccount"
    account.mkdir(parents=True)
    return account


def test_a_fifo_as_a_pods_namespace_file_is_skipped_not_waited_on(tmp_path, caplog):
    d = pod(tmp_path, 70, b"RANK=3\0", "research", hostname=b"llama-worker-3")
    os.mkfifo(account_dir(d) / "namespace")  # no writer: a plain open() would wait forever
    att = JobAttributor(tmp_path, node="gpu-07")
    with caplog.at_level(logging.WARNING):
        assert bounded(lambda: att.pod_for((70,))) == Pod("research", "llama-worker-3")  # resolv.conf's
    assert att.errors["namespace:not_regular_file"] == 1
    assert [r.kind for r in caplog.records if r.getMessage().startswith("not a regular file")] == ["fifo"]


def test_a_fifo_as_resolv_conf_is_skipped_not_waited_on(tmp_path):
    d = pod(tmp_path, 71, b"MASTER_ADDR=llama-master-0\0MASTER_PORT=23456\0", None)
    (d / "root" / "etc").mkdir(parents=True)
    os.mkfifo(d / "root" / "etc" / "resolv.conf")
    att = JobAttributor(tmp_path, node="gpu-07")
    assert bounded(lambda: att.job_for(0, "GPU-a", (71,))) == "llama-master-0:23456"
    assert att.errors["resolv.conf:not_regular_file"] >= 1


def test_an_absolute_symlink_in_a_container_resolves_inside_it_not_on_the_host(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "namespace").write_text("kube-system")  # what the host (or another pod) holds there
    procfs = tmp_path / "proc"
    procfs.mkdir()
    d = pod(procfs, 72, b"RANK=3\0", "research", hostname=b"llama-worker-3")
    (account_dir(d) / "namespace").symlink_to(host / "namespace")  # an absolute link, from the container
    att = JobAttributor(procfs, node="gpu-07")
    assert att.pod_for((72,)) == Pod("research", "llama-worker-3")  # not kube-system: resolv.conf's
    # The same path inside the container is what the link means there.
    inside = d / "root" / str(host).lstrip("/")
    inside.mkdir(parents=True)
    (inside / "namespace").write_text("vision")
    assert JobAttributor(procfs, node="gpu-07").pod_for((72,)) == Pod("vision", "llama-worker-3")


def test_dot_dot_stops_at_the_container_root(tmp_path):
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (tmp_path / "namespace").write_text("kube-system")
    d = pod(procfs, 73, b"RANK=3\0", "research", hostname=b"llama-worker-3")
    (account_dir(d) / "namespace").symlink_to("../" * 12 + "namespace")
    assert JobAttributor(procfs, node="gpu-07").pod_for((73,)) == Pod("research", "llama-worker-3")
    (d / "root" / "namespace").write_text("vision")  # the container's own /namespace
    assert JobAttributor(procfs, node="gpu-07").pod_for((73,)) == Pod("vision", "llama-worker-3")


def test_symlinks_inside_the_container_are_followed(tmp_path):
    # systemd-resolved images: /etc/resolv.conf -> ../run/systemd/resolve/stub-resolv.conf, or absolute.
    d = pod(tmp_path, 74, b"MASTER_ADDR=coord\0MASTER_PORT=1234\0", None)
    stub = d / "root" / "run" / "systemd" / "resolve"
    stub.mkdir(parents=True)
    (stub / "stub-resolv.conf").write_text("search ml.svc.cluster.local\n")
    (d / "root" / "etc").mkdir(parents=True)
    (d / "root" / "etc" / "resolv.conf").symlink_to("/run/systemd/resolve/stub-resolv.conf")
    assert JobAttributor(tmp_path, node="gpu-07").job_for(0, "GPU-a", (74,)) == "coord.ml.svc.cluster.local:1234"
    (d / "root" / "etc" / "resolv.conf").unlink()
    (d / "root" / "etc" / "resolv.conf").symlink_to("../run/./systemd/resolve/stub-resolv.conf")
    assert JobAttributor(tmp_path, node="gpu-07").job_for(0, "GPU-a", (74,)) == "coord.ml.svc.cluster.local:1234"


def test_a_symlink_loop_is_an_error_not_a_hang(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "a").symlink_to("b")
    (root / "etc" / "b").symlink_to("/etc/a")
    with pytest.raises(OSError) as info:
        read_in_root(root, "etc/a", 100)
    assert info.value.errno == errno.ELOOP


def test_reads_are_capped_and_only_regular_files_are_opened(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "big").write_bytes(b"x" * (MAX_CONTAINER_FILE_BYTES * 4))
    assert len(read_in_root(root, "/big", MAX_CONTAINER_FILE_BYTES)) == MAX_CONTAINER_FILE_BYTES
    with pytest.raises(NotRegularFile) as info:
        read_regular("/dev/zero", 10)  # endless, and a device: refused before it is opened
    assert info.value.kind == "char_device"
    with pytest.raises(NotRegularFile):
        read_in_root(root, ".", 10)


# --- off the sampler's critical path -------------------------------------------------------------------


def test_the_background_attributor_answers_from_the_last_finished_cycle(tmp_path):
    proc(tmp_path, 80, b"SLURM_JOB_ID=4242\0")
    proc(tmp_path, 81, b"SLURM_JOB_ID=4243\0")
    att = BackgroundAttributor(JobAttributor(tmp_path), start=False)
    assert att.job_for(0, "GPU-a", (80,)) is None  # not looked at yet
    att.end_cycle()
    assert att.resolve_pending()
    assert att.job_for(0, "GPU-a", (80,)) == "4242"
    assert att.job_for(0, "GPU-a", (81,)) == "4242"  # new processes: the last answer until looked at
    assert att.job_for(1, "GPU-b", ()) is None  # no processes: no job at once
    att.end_cycle()
    att.resolve_pending()
    assert att.job_for(0, "GPU-a", (81,)) == "4243"
    assert att.job_for(0, "GPU-z", (81,)) is None  # another GPU at that index: nothing carried over


def test_the_same_questions_again_are_not_handed_to_the_thread_where_pids_decide(tmp_path):
    proc(tmp_path, 80, b"SLURM_JOB_ID=4242\0")
    proc(tmp_path, 81, b"SLURM_JOB_ID=4243\0")
    att = BackgroundAttributor(JobAttributor(tmp_path), start=False)
    att.job_for(0, "GPU-a", (80,))
    att.end_cycle()
    assert att.resolve_pending()
    assert att.job_for(0, "GPU-a", (80,)) == "4242"
    att.end_cycle()
    assert not att.resolve_pending()  # a steady job: nothing to answer, the thread stays asleep
    assert att.job_for(0, "GPU-a", (81,)) == "4242"
    att.end_cycle()
    assert att.resolve_pending()  # new processes are looked at
    assert att.job_for(0, "GPU-a", (81,)) == "4243"


def test_a_mapping_directory_is_read_again_every_cycle(tmp_path):
    mapping = tmp_path / "map"
    mapping.mkdir()
    att = BackgroundAttributor(JobAttributor(tmp_path, mapping_dir=mapping), start=False)
    for _ in range(2):  # the files may change under the same processes
        att.job_for(0, "GPU-a", ())
        att.end_cycle()
        assert att.resolve_pending()


def test_a_read_stuck_in_the_kernel_does_not_stop_sampling(tmp_path):
    from gpufleet.agent.sampler import Sampler
    from gpufleet.agent.store import SnapshotStore
    from tests.agent.fakes import FakeClock, StubReader

    proc(tmp_path, 90, b"SLURM_JOB_ID=4242\0")
    inner = JobAttributor(tmp_path)
    entered, release = threading.Event(), threading.Event()
    real_environ = inner._environ

    def stuck_environ(pid):  # /proc/PID/environ of a process whose mmap lock is held
        entered.set()
        release.wait(30)
        return real_environ(pid)

    inner._environ = stuck_environ
    att = BackgroundAttributor(inner)
    clock = FakeClock()
    sampler = Sampler(
        StubReader(gpus=1, pids={0: (90,)}),
        SnapshotStore(),
        node="n",
        attributor=att,
        clock=clock.time,
        monotonic=clock.monotonic,
    )
    try:
        assert bounded(sampler.run_once).gpus[0].hpc_job is None
        assert entered.wait(10)
        for _ in range(3):  # the thread is stuck; sampling is not
            clock.advance(1)
            assert bounded(sampler.run_once).gpus[0].hpc_job is None
        release.set()
        assert att.wait_idle(10)
        clock.advance(1)
        assert sampler.run_once().gpus[0].hpc_job == "4242"
    finally:
        release.set()
        att.close()
