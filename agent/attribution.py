"""Which job uses each GPU (a dcgm-exporter style mapping directory, or the GPU's processes in procfs), and
in which Kubernetes pod its processes run."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable, Mapping, Protocol

log = logging.getLogger(__name__)

# Slurm's cgroup layouts, v1 (/slurm/uid_0/job_42/step_0) and v2 (.../slurmstepd.scope/job_42/step_0).
_CGROUP_JOB = re.compile(r"/job_(\d+)(?:/|$)")
# Slurm sets SLURM_JOB_ID in every step. Kubernetes sets nothing that names a job (a pod is one node's
# share of it), so training pods are asked to carry GPUFLEET_JOB from their job label (docs/agent.md).
DEFAULT_ENV_VARS: tuple[str, ...] = ("SLURM_JOB_ID", "GPUFLEET_JOB")
# Slurm ids, and Kubernetes NAMESPACE/NAME (63 characters each); anything else is ignored, not exported.
_JOB_ID = re.compile(r"^[0-9A-Za-z_.+:/-]{1,128}$")
# Every rank of a PyTorch job (torchrun, the Kubeflow training operator, DeepSpeed, Accelerate) is told its
# rendezvous, as is every process of a multi-host JAX job, and no two running jobs share one: the job's
# own identity where nothing else names it (a Kubernetes pod without GPUFLEET_JOB).
_MASTER_ADDR, _MASTER_PORT, _JAX_COORDINATOR = b"MASTER_ADDR=", b"MASTER_PORT=", b"JAX_COORDINATOR_ADDRESS="
_WORLD_SIZE = b"WORLD_SIZE="
_RENDEZVOUS_PREFIXES = (_MASTER_ADDR, _MASTER_PORT, _JAX_COORDINATOR, _WORLD_SIZE)
_HOST = re.compile(r"^[0-9A-Za-z_.:-]{1,100}$")
# A pod's process: its cgroup is under the kubelet's kubepods hierarchy (cgroup v1 and v2, either driver).
_KUBEPODS = b"kubepods"
_HOSTNAME = b"HOSTNAME="
# Kubernetes object names (RFC 1123): a namespace is a DNS label, a pod name a DNS subdomain.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_SERVICE_ACCOUNT_NAMESPACE = Path("var/run/secrets/kubernetes.io/serviceaccount/namespace")
_LOCAL_HOSTS = frozenset(("localhost", "localhost.localdomain", "ip6-localhost", "0.0.0.0", "::"))
# environ can be large (module systems); a job id is near the start, and the read stays bounded.
MAX_READ_BYTES = 1 << 20
# A namespace file or resolv.conf inside a container is a few hundred bytes; more is not read.
MAX_CONTAINER_FILE_BYTES = 64 << 10
# As the kernel's own limit on symlinks followed in one lookup.
MAX_SYMLINKS = 40
_OPEN_FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REWARN_SECONDS = 600.0


class WarnOnce:
    """Logs a warning the first time a cause appears, then at most every ten minutes with a count."""

    def __init__(self, logger: logging.Logger, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._monotonic = monotonic
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def __call__(self, cause: str, message: str, **context: object) -> None:
        now = self._monotonic()
        last = self._last.get(cause)
        if last is not None and now - last < _REWARN_SECONDS:
            self._suppressed[cause] += 1
            return
        self._last[cause] = now
        repeats = self._suppressed.pop(cause, 0)
        self._log.warning(message, extra={"cause": cause, "repeats_since_last": repeats, **context})

    @property
    def causes(self) -> frozenset[str]:
        """Every cause warned about so far."""
        return frozenset(self._last)


@dataclass(frozen=True, slots=True)
class Pod:
    """The Kubernetes pod a GPU's processes run in."""

    namespace: str
    name: str


class Attributor(Protocol):
    """What the sampler asks: JobAttributor, agent.podresources.KubeletAttributor or BackgroundAttributor."""

    @property
    def uses_mapping_dir(self) -> bool: ...
    @property
    def errors(self) -> Mapping[str, int]: ...
    def job_for(self, index: int, uuid: str, pids: Iterable[int]) -> str | None: ...
    def pod_for(self, pids: Iterable[int]) -> Pod | None: ...
    def end_cycle(self) -> None: ...


class InnerAttributor(Attributor, Protocol):
    """What BackgroundAttributor runs on its thread: JobAttributor (/proc, a mapping directory), or
    agent.podresources.KubeletAttributor (the kubelet first)."""

    @property
    def by_allocation(self) -> bool: ...
    def note(self, what: str, code: str, message: str, **context: object) -> None: ...


class JobAttributor:
    """Maps a GPU to the job of its compute processes; the mapping directory, when set, wins.

    A process's job is the first of `env_vars` its environment sets to a valid id, else the Slurm job of
    its cgroup, else (with `rendezvous`) its job's rendezvous endpoint, HOST:PORT: a short host name is
    completed with the process's first DNS search domain (in a Kubernetes pod, NAMESPACE.svc.DOMAIN: jobs
    of one name in two namespaces stay apart), a loopback one is put under its pod, or else under `node`
    (a one-node job). A process told WORLD_SIZE=1 has no job to share.
    """

    def __init__(
        self,
        procfs: str | os.PathLike[str] = "/proc",
        mapping_dir: str | os.PathLike[str] | None = None,
        *,
        env_vars: tuple[str, ...] = DEFAULT_ENV_VARS,
        rendezvous: bool = True,
        node: str = "localhost",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._procfs = Path(procfs)
        self._mapping_dir = Path(mapping_dir) if mapping_dir is not None else None
        self._env_prefixes = tuple(f"{name}=".encode() for name in env_vars)
        self._rendezvous = rendezvous
        self._node = node
        self._cache: dict[int, tuple[str | None, Pod | None]] = {}
        self._seen: set[int] = set()
        self.warn = WarnOnce(log, monotonic)
        self.errors: Counter[str] = Counter()

    @property
    def uses_mapping_dir(self) -> bool:
        """True when jobs come from the mapping directory rather than procfs."""
        return self._mapping_dir is not None

    @property
    def by_allocation(self) -> bool:
        """True when the last answer came from what the GPU is allocated to, not from its processes: it
        stands while the GPU runs none."""
        return self._mapping_dir is not None

    @property
    def answers_from_pids(self) -> bool:
        """True when the same pids always get the same answers (each process is read once, then cached)."""
        return self._mapping_dir is None

    def job_for(self, index: int, uuid: str, pids: Iterable[int]) -> str | None:
        """The job using GPU `index`; None when no process on it belongs to a job we can see."""
        if self._mapping_dir is not None:
            return self._from_mapping(index, uuid)
        jobs = [job for job in (self._pid_entry(pid)[0] for pid in pids) if job is not None]
        return _pick(jobs)

    def pod_for(self, pids: Iterable[int]) -> Pod | None:
        """The pod of the GPU's processes (the one with most of them); None outside Kubernetes, with a
        mapping directory, or where the pod cannot be told (host networking hides its name)."""
        if self._mapping_dir is not None:
            return None
        pods = Counter(pod for pod in (self._pid_entry(pid)[1] for pid in pids) if pod is not None)
        return max(pods, key=lambda p: (pods[p], p.namespace, p.name)) if pods else None

    def end_cycle(self) -> None:
        """Forget pids that no GPU reported this cycle: their ids may be reused by unrelated processes."""
        for pid in self._cache.keys() - self._seen:
            del self._cache[pid]
        self._seen.clear()

    def _pid_entry(self, pid: int) -> tuple[str | None, Pod | None]:
        """(job, pod) of one process, read once while NVML keeps reporting it."""
        self._seen.add(pid)
        entry = self._cache.get(pid)
        if entry is None:
            found = self._environ(pid)
            cgroup = self._read(self._procfs / str(pid) / "cgroup", "cgroup")
            job = next(
                (
                    job
                    for job in (
                        _valid_job(found[p].decode("ascii", "replace")) for p in self._env_prefixes if p in found
                    )
                    if job is not None
                ),
                None,
            )
            if job is None:
                job = _slurm_job(cgroup)
            pod = self._pod(pid, found) if cgroup is not None and _KUBEPODS in cgroup else None
            if job is None and self._rendezvous:
                job = self._job_from_rendezvous(pid, found, pod)
            entry = self._cache[pid] = (job, pod)
        return entry

    def _pod(self, pid: int, found: dict[bytes, bytes]) -> Pod | None:
        """A pod process's namespace (its service account's, else its resolver's NAMESPACE.svc search
        domain) and name (its hostname, unless that is the node's: host networking)."""
        name = found.get(_HOSTNAME, b"").decode("ascii", "replace").strip().lower()
        node = self._node.lower()
        if not _DNS_SUBDOMAIN.match(name) or name.split(".")[0] == node.split(".")[0]:
            return None
        data = self._read(
            _SERVICE_ACCOUNT_NAMESPACE,
            "namespace",
            missing_ok=True,
            root=self._root(pid),
            limit=MAX_CONTAINER_FILE_BYTES,
        )
        namespace = (data or b"").decode("ascii", "replace").strip()
        if not namespace:
            domain = self._search_domain(pid) or ""
            head, sep, _ = domain.partition(".svc.")
            namespace = head if sep else ""
        return Pod(namespace, name) if _DNS_LABEL.match(namespace) else None

    def _root(self, pid: int) -> Path:
        """The process's root directory: its container's file system as the process sees it."""
        return self._procfs / str(pid) / "root"

    def _environ(self, pid: int) -> dict[bytes, bytes]:
        """The variables of the process's environment that can name its job, by `NAME=` prefix."""
        data = self._read(self._procfs / str(pid) / "environ", "environ")
        if data is None:
            return {}
        wanted = self._env_prefixes + _RENDEZVOUS_PREFIXES + (_HOSTNAME,)
        found: dict[bytes, bytes] = {}
        for entry in data.split(b"\0"):
            for prefix in wanted:
                if entry.startswith(prefix):
                    found.setdefault(prefix, entry[len(prefix) :])  # the first wins, as getenv(3) reads it
        return found

    def _job_from_rendezvous(self, pid: int, found: dict[bytes, bytes], pod: Pod | None) -> str | None:
        if found.get(_WORLD_SIZE, b"").strip() == b"1":
            return None  # a job of one process: anything sharing its rendezvous is unrelated
        if _MASTER_ADDR in found and _MASTER_PORT in found:
            host, port = found[_MASTER_ADDR], found[_MASTER_PORT]
        elif _JAX_COORDINATOR in found:
            host, _, port = found[_JAX_COORDINATOR].rpartition(b":")
        else:
            return None
        host_text = host.decode("ascii", "replace").strip().strip("[]").lower()
        port_text = port.decode("ascii", "replace").strip()
        if not _HOST.match(host_text) or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        if host_text in _LOCAL_HOSTS or host_text.startswith("127.") or host_text == "::1":
            # Loopback is one network namespace's: a pod's own (pods on one node may all say localhost:29500),
            # else the node's.
            scope = f"{pod.namespace}/{pod.name}" if pod is not None else self._node
            return _valid_job(f"{scope}/{host_text}:{port_text}")
        if "." not in host_text and ":" not in host_text:
            domain = self._search_domain(pid)
            if domain:
                host_text = f"{host_text}.{domain}"
        return _valid_job(f"{host_text}:{port_text}")

    def _search_domain(self, pid: int) -> str | None:
        """The first search domain of the process's own resolv.conf: what its resolver appends to a short
        name, so the name it connects to."""
        data = self._read(
            Path("etc/resolv.conf"),
            "resolv.conf",
            missing_ok=True,
            root=self._root(pid),
            limit=MAX_CONTAINER_FILE_BYTES,
        )
        for line in (data or b"").decode("ascii", "replace").splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] in ("search", "domain"):
                domain = words[1].strip(".").lower()
                return domain if _HOST.match(domain) else None
        return None

    def _from_mapping(self, index: int, uuid: str) -> str | None:
        assert self._mapping_dir is not None
        for name in (str(index), uuid):
            data = self._read(self._mapping_dir / name, "mapping", missing_ok=True)
            if data is not None:
                # Prologs append; the last id listed is the job that got the GPU most recently.
                ids = [_valid_job(line) for line in data.decode("utf-8", "replace").splitlines()]
                ids = [i for i in ids if i is not None]
                return ids[-1] if ids else None
        if not self._mapping_dir.is_dir():
            self._note("mapping", "ENOENT", "hpc job mapping directory is missing", path=str(self._mapping_dir))
        return None

    def _read(
        self, path: Path, what: str, *, missing_ok: bool = False, root: Path | None = None, limit: int = MAX_READ_BYTES
    ) -> bytes | None:
        """A regular file's first `limit` bytes, or None; with `root`, `path` is taken inside that container
        root. Never blocks on a FIFO or device, and never raises: a failure is counted and warned about."""
        try:
            return read_regular(path, limit) if root is None else read_in_root(root, path, limit)
        except FileNotFoundError:
            # A process that exited between NVML's answer and our read is normal, not a warning;
            # a procfs root that is not there at all (container without hostPID, wrong --path.procfs) is.
            if not missing_ok and not self._procfs.is_dir():
                self._note("procfs", "ENOENT", "procfs root is missing", path=str(self._procfs))
            return None
        except NotRegularFile as exc:
            self._note(
                what,
                "not_regular_file",
                "not a regular file; not read for job attribution",
                path=str(path),
                kind=exc.kind,
            )
            return None
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
            self._note(what, code, "cannot read for job attribution", path=str(path), error=exc.strerror)
            return None

    def note(self, what: str, code: str, message: str, **context: object) -> None:
        """Count a failure by `what:code` and warn about it (once per cause, then every ten minutes)."""
        self._note(what, code, message, **context)

    def _note(self, what: str, code: str, message: str, **context: object) -> None:
        self.errors[f"{what}:{code}"] += 1
        self.warn(f"{what}:{code}", message, **context)


@dataclass(frozen=True, slots=True)
class _Answer:
    """What the attributor found for one GPU, and for which processes."""

    uuid: str
    pids: tuple[int, ...]
    job: str | None
    pod: Pod | None
    by_allocation: bool


class BackgroundAttributor:
    """A JobAttributor run on its own thread, off the sampler's critical path: the sampler's questions get
    the last answer known for each GPU at once, and every cycle's questions are handed to the thread to
    answer for the next. Reading /proc/PID/environ blocks while the process's memory map is locked (a
    process stuck in the kernel), and a container's files are the container's to break: either would
    otherwise stop sampling. While the thread is stuck only the newest cycle's questions wait, and a GPU
    keeps its last answer; a GPU whose processes have all gone has no job at once."""

    def __init__(self, inner: InnerAttributor, *, start: bool = True) -> None:
        self._inner = inner
        self.uses_mapping_dir = inner.uses_mapping_dir
        self._asked: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._current: int | None = None
        self._answers: Mapping[int, _Answer] = {}
        self._errors: Mapping[str, int] = {}
        self._changed = threading.Condition()
        self._pending: dict[int, tuple[str, tuple[int, ...]]] | None = None
        # The questions last handed to the thread; where answers follow from the pids alone, the same
        # questions again need no answering, and the thread is not woken for them.
        self._handed: dict[int, tuple[str, tuple[int, ...]]] | None = None
        self._from_pids = bool(getattr(inner, "answers_from_pids", False))
        self._busy = False
        self._stopped = False
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="gpufleet-attribution", daemon=True)
            self._thread.start()

    @property
    def errors(self) -> Mapping[str, int]:
        """The inner attributor's error counts as of its last finished cycle."""
        return self._errors

    def job_for(self, index: int, uuid: str, pids: Iterable[int]) -> str | None:
        """The last known job of GPU `index`; records the question for the thread."""
        answer = self._ask(index, uuid, tuple(pids))
        return answer.job if answer is not None else None

    def pod_for(self, pids: Iterable[int]) -> Pod | None:
        """The last known pod of the GPU just asked about with job_for (the sampler asks both in turn)."""
        if self._current is None or self.uses_mapping_dir:
            return None
        uuid, asked = self._asked[self._current]
        answer = self._known(self._current, uuid, asked)
        return answer.pod if answer is not None else None

    def end_cycle(self) -> None:
        """Hand this cycle's questions to the thread, replacing any it has not started on; the questions
        last handed, asked again of an attributor that answers from pids alone, are not handed again (a
        steady job's GPUs ask the same every cycle, and waking the thread costs more than its answers)."""
        asked, self._asked, self._current = self._asked, {}, None
        with self._changed:
            if self._from_pids and self._pending is None and asked == self._handed:
                return
            self._pending = self._handed = asked
            self._changed.notify_all()

    def resolve_pending(self) -> bool:
        """Answer the waiting cycle's questions on the calling thread (the thread's loop; tests without it)."""
        with self._changed:
            batch, self._pending = self._pending, None
            if batch is None:
                return False
            self._busy = True
        try:
            answers = {}
            for index, (uuid, pids) in batch.items():
                try:
                    job = self._inner.job_for(index, uuid, pids)
                    pod = self._inner.pod_for(pids)
                    allocated = self._inner.by_allocation
                except Exception as exc:  # a bug in one answer must not end attribution
                    self._inner.note("attribution", type(exc).__name__, "job attribution failed", error=repr(exc))
                    job, pod, allocated = None, None, False
                answers[index] = _Answer(uuid, pids, job, pod, allocated)
            self._inner.end_cycle()
            # Swapped whole: the sampler reads them without a lock, never half-updated.
            self._answers, self._errors = answers, dict(self._inner.errors)
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
        return True

    def wait_idle(self, timeout: float) -> bool:
        """Until every cycle handed over has been answered (tests, shutdown); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread; one stuck in a read is left behind (it is a daemon)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _ask(self, index: int, uuid: str, pids: tuple[int, ...]) -> _Answer | None:
        self._asked[index] = (uuid, pids)
        self._current = index
        return self._known(index, uuid, pids)

    def _known(self, index: int, uuid: str, pids: tuple[int, ...]) -> _Answer | None:
        answer = self._answers.get(index)
        if not pids and not self.uses_mapping_dir and (answer is None or not answer.by_allocation):
            return None  # no process on the GPU: no job, whatever was there before
        # Processes that changed since are still taken as the last job's until the thread has looked:
        # a job label that blinked away for a cycle would split every series it is on.
        return answer if answer is not None and answer.uuid == uuid else None

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._stopped)
                if self._stopped:
                    return
            try:
                self.resolve_pending()
            except Exception:  # belt and braces: resolve_pending contains its own failures
                log.exception("job attribution cycle failed")


class NotRegularFile(OSError):
    """A FIFO, socket or device where a regular file was expected: opening or reading it could block."""

    def __init__(self, path: str, mode: int) -> None:
        self.kind = _KINDS.get(stat.S_IFMT(mode), "other")
        super().__init__(errno.EINVAL, f"not a regular file ({self.kind})", path)


_KINDS = {
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "char_device",
    stat.S_IFBLK: "block_device",
    stat.S_IFDIR: "directory",
    stat.S_IFLNK: "symlink",
}


def read_regular(
    path: os.PathLike[str] | str, limit: int, *, dir_fd: int | None = None, follow_symlinks: bool = True
) -> bytes:
    """The first `limit` bytes of a regular file. Anything else raises NotRegularFile before it is opened
    (a FIFO would block the reader until a writer came, a device may act on open) and again after (in case
    it was swapped in between); the open itself is non-blocking."""
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(str(path), st.st_mode)
    flags = _OPEN_FILE if not follow_symlinks else _OPEN_FILE & ~os.O_NOFOLLOW
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(str(path), mode)
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_in_root(root: Path, path: os.PathLike[str] | str, limit: int) -> bytes:
    """read_regular of `path` inside the directory tree `root` (a container's /proc/PID/root) as a process
    chrooted there would see it: every symlink on the way, absolute or relative, resolves against `root`,
    and ".." stops at it, so nothing outside the container is ever opened. Each component is opened with
    O_NOFOLLOW relative to its parent's descriptor; symlinks are read and walked by hand."""
    # Following /proc/PID/root itself is the point: the kernel's link to the process's root directory.
    dirs = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        pending = _components(str(path))
        followed = 0
        while pending:
            name = pending.pop()
            if name == "..":
                if len(dirs) > 1:
                    os.close(dirs.pop())
                continue
            st = os.stat(name, dir_fd=dirs[-1], follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                followed += 1
                if followed > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", str(path))
                target = os.readlink(name, dir_fd=dirs[-1])
                if target.startswith("/"):
                    while len(dirs) > 1:
                        os.close(dirs.pop())
                pending.extend(_components(target))
            elif not pending:
                return read_regular(name, limit, dir_fd=dirs[-1], follow_symlinks=False)
            else:
                dirs.append(os.open(name, _OPEN_DIR, dir_fd=dirs[-1]))
        raise NotRegularFile(str(path), stat.S_IFDIR)
    finally:
        for fd in dirs:
            os.close(fd)


def _components(path: str) -> list[str]:
    """Path components to walk, as a stack (the first on top); "." and empty ones dropped."""
    return [part for part in reversed(PurePosixPath(path).parts) if part not in ("/", ".", "")]


def _slurm_job(cgroup: bytes | None) -> str | None:
    """The job of a Slurm cgroup path (/proc/PID/cgroup's contents), if it is one."""
    for line in (cgroup or b"").decode("utf-8", "replace").splitlines():
        match = _CGROUP_JOB.search(line)
        if match:
            return match.group(1)
    return None


def _valid_job(text: str) -> str | None:
    text = text.strip()
    return text if _JOB_ID.match(text) else None


def _pick(jobs: list[str]) -> str | None:
    """The job with the most processes on the GPU; ties go to the newest (highest numeric) id."""
    if not jobs:
        return None
    counts = Counter(jobs)
    return max(counts, key=lambda job: (counts[job], _numeric(job), job))


def _numeric(job: str) -> int:
    head = job.split("_", 1)[0]
    return int(head) if head.isdigit() else -1
