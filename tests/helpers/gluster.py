"""Real GlusterFS volumes on 127.0.0.1 for tests (tests/test_glusterfs.py).

:class:`GlusterSession` installs GlusterFS if ``glusterd`` is missing (Debian packages,
quiet, non-interactive), starts one ``glusterd`` for the session (or reuses a running
one), and creates on demand one volume per layout, each mounted twice through FUSE:

* ``"single"``: one brick;
* ``"replica"``: ``replica 2`` over two bricks;
* ``"distribute"``: two bricks, plain DHT (a file lives on the brick its name hashes to).

``close()`` tears everything down, also after a failed test: unmount (``umount -l``
fallback), stop and delete the volumes, stop the ``glusterd`` it started (by pid),
remove the brick directories. Every command has a timeout; the steps that glusterd is
known to refuse right after it starts ("another transaction is in progress", bricks not
listening yet) are retried.

When GlusterFS cannot run here at all (not root, no /dev/fuse, the packages cannot be
installed, glusterd does not start) :class:`GlusterUnavailable` carries one line saying
why; the tests skip with it. Later failures (a volume that cannot be created or mounted)
raise :class:`GlusterError` with gluster's own output.

No pytest import here: usable from a plain script as a context manager::

    with GlusterSession() as gs:
        m1, m2 = gs.volume("distribute")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

LAYOUTS = ("single", "replica", "distribute")
HOST = "kvtest-gluster"  # a name for 127.0.0.1: the CLI refuses localhost / 127.0.0.1
PACKAGES = ("glusterfs-server", "glusterfs-client")
_VOLFILE = """volume management
    type mgmt/glusterd
    option working-directory /var/lib/glusterd
    option transport-type socket
    option transport.socket.bind-address 127.0.0.1
    option transport.socket.listen-port 24007
    option transport.socket.read-fail-log off
    option ping-timeout 0
    option event-threads 1
    option max-port 60999
end-volume
"""
# gluster's answers that mean "not ready yet, ask again"
_TRANSIENT = ("another transaction", "locking failed", "is not connected", "not ready",
              "connection failed", "failed to get", "try again", "staging failed",
              "commit failed", "transport endpoint", "is already in use")


class GlusterUnavailable(RuntimeError):
    """GlusterFS cannot run on this machine; str() is the one-line reason."""


class GlusterError(RuntimeError):
    """A gluster step failed (with the command and its output)."""


def run(cmd: list[str], timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a timeout; GlusterError with its output on failure."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise GlusterError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from e
    except FileNotFoundError as e:
        raise GlusterError(f"not installed: {cmd[0]}") from e
    if check and p.returncode != 0:
        raise GlusterError(f"failed ({p.returncode}): {' '.join(cmd)}\n"
                           f"{(p.stdout + p.stderr).strip()[-2000:]}")
    return p


def gluster(*args: str, timeout: float = 60, retries: float = 40.0) -> str:
    """``gluster --mode=script ARGS``, retried for up to ``retries`` seconds while
    glusterd answers with a transient error."""
    cmd = ["gluster", "--mode=script", *args]
    deadline = time.monotonic() + retries
    while True:
        try:
            return run(cmd, timeout=timeout).stdout
        except GlusterError as e:
            text = str(e).lower()
            if time.monotonic() > deadline or not (
                    "timed out" in text or any(t in text for t in _TRANSIENT)):
                raise
        time.sleep(1.0)


def unavailable_reason() -> str | None:
    """Why GlusterFS cannot run here (before anything is installed or started), or None."""
    if os.geteuid() != 0:
        return "GlusterFS tests need root (glusterd, mount -t glusterfs)"
    if not os.path.exists("/dev/fuse"):
        return "GlusterFS tests need /dev/fuse (FUSE mounts)"
    return None


def ensure_installed() -> None:
    """Install the Debian packages if glusterd is missing (GlusterUnavailable if not)."""
    if shutil.which("glusterd") and shutil.which("mount.glusterfs"):
        return
    if not shutil.which("apt-get"):
        raise GlusterUnavailable("glusterd is not installed and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "-o", "Dpkg::Use-Pty=0", *PACKAGES]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:  # stale package lists: update once and retry
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300,
                           env=env, stdin=subprocess.DEVNULL)
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                               stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise GlusterUnavailable("apt-get install glusterfs-server timed out") from e
    if p.returncode != 0 or not shutil.which("glusterd"):
        last = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        raise GlusterUnavailable(f"cannot install glusterfs-server: {last[0]}")


def ensure_host(name: str = HOST) -> str:
    """A host name that resolves to 127.0.0.1 (added to /etc/hosts if needed)."""
    try:
        if socket.gethostbyname(name) == "127.0.0.1":
            return name
    except OSError:
        pass
    with open("/etc/hosts", "a") as f:
        f.write(f"\n127.0.0.1 {name}\n")
    if socket.gethostbyname(name) != "127.0.0.1":
        raise GlusterUnavailable(f"cannot make host name {name} resolve to 127.0.0.1")
    return name


def _glusterd_answers() -> bool:
    try:
        run(["gluster", "--mode=script", "volume", "list"], timeout=10)
        return True
    except GlusterError:
        return False


class GlusterSession:
    """One glusterd (started here unless already running) and one volume per layout."""

    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvgluster-")
        self._own_workdir = workdir is None
        self.proc: subprocess.Popen | None = None  # the glusterd this session started
        self.volumes: dict[str, tuple[str, str]] = {}
        #: brick directories of each layout's volume (the servers' own view of the files)
        self.bricks: dict[str, list[str]] = {}
        self._mounts: list[str] = []
        self._vols: list[str] = []
        self.timings: dict[str, float] = {}
        self.host = HOST

    # ------------------------------------------------------------------ daemon
    def start(self) -> GlusterSession:
        """Install + start glusterd; GlusterUnavailable (one line) if it cannot run."""
        t0 = time.monotonic()
        why = unavailable_reason()
        if why:
            raise GlusterUnavailable(why)
        ensure_installed()
        self.host = ensure_host()
        if not _glusterd_answers():
            vol = os.path.join(self.workdir, "glusterd.vol")
            with open(vol, "w") as f:
                f.write(_VOLFILE)
            os.makedirs("/var/lib/glusterd", exist_ok=True)
            log = open(os.path.join(self.workdir, "glusterd.out"), "w")  # noqa: SIM115
            try:
                self.proc = subprocess.Popen(
                    ["glusterd", "-N", "-f", vol, "-l",
                     os.path.join(self.workdir, "glusterd.log")],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True)
            except OSError as e:
                raise GlusterUnavailable(f"cannot start glusterd: {e}") from e
            finally:
                log.close()
            deadline = time.monotonic() + 30
            while not _glusterd_answers():
                if self.proc.poll() is not None:
                    tail = self._log_tail()
                    self.proc = None
                    raise GlusterUnavailable(f"glusterd exited at start: {tail}")
                if time.monotonic() > deadline:
                    self.close()
                    raise GlusterUnavailable("glusterd did not answer within 30 s")
                time.sleep(0.5)
        self.timings["glusterd_s"] = time.monotonic() - t0
        return self

    def _log_tail(self) -> str:
        for name in ("glusterd.out", "glusterd.log"):
            with contextlib.suppress(OSError):
                with open(os.path.join(self.workdir, name)) as f:
                    lines = [ln.strip() for ln in f if " E " in ln or "rror" in ln]
                if lines:
                    return lines[-1][-300:]
        return "no error in its log"

    # ------------------------------------------------------------------ volumes
    def volume(self, layout: str) -> tuple[str, str]:
        """Two FUSE mounts of this session's volume of ``layout`` (created on first use)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        if layout in self.volumes:
            return self.volumes[layout]
        t0 = time.monotonic()
        name = f"kvt{layout[:4]}{os.getpid()}"
        nbricks = 1 if layout == "single" else 2
        bricks = []
        for i in range(nbricks):
            b = os.path.join(self.workdir, f"brick-{layout}-{i}")
            os.makedirs(b, exist_ok=True)
            bricks.append(f"{self.host}:{b}")
        args = ["volume", "create", name]
        if layout == "replica":
            args += ["replica", "2"]
        gluster(*args, *bricks, "force")
        self._vols.append(name)
        self.bricks[layout] = [b.split(":", 1)[1] for b in bricks]
        gluster("volume", "start", name)
        mounts = []
        for i in (1, 2):
            m = os.path.join(self.workdir, f"mnt-{layout}-{i}")
            os.makedirs(m, exist_ok=True)
            self._mount(name, m)
            mounts.append(m)
        self.volumes[layout] = (mounts[0], mounts[1])
        self.timings[f"{layout}_s"] = time.monotonic() - t0
        return self.volumes[layout]

    def extra_mount(self, layout: str, tag: str) -> str:
        """One more FUSE mount (its own client process) of ``layout``'s volume, e.g. for a
        test that kills it; unmounted (lazily, if dead) at teardown."""
        self.volume(layout)
        name = next(v for v in self._vols if v.startswith(f"kvt{layout[:4]}"))
        m = os.path.join(self.workdir, f"mnt-{layout}-{tag}")
        os.makedirs(m, exist_ok=True)
        self._mount(name, m)
        return m

    @staticmethod
    def client_pid(mnt: str) -> int:
        """PID of the glusterfs FUSE client process serving mount point ``mnt``."""
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if args and os.path.basename(args[0]) == b"glusterfs" and (
                    mnt.encode() in args):
                return int(d)
        raise GlusterError(f"no glusterfs client process for {mnt}")

    def _mount(self, name: str, mnt: str) -> None:
        """Mount, retried while the bricks come up (a mount that succeeds but whose
        volume is not reachable yet shows up as ENOTCONN on the first stat)."""
        deadline = time.monotonic() + 40
        last = ""
        while time.monotonic() < deadline:
            try:
                run(["mount", "-t", "glusterfs", f"{self.host}:/{name}", mnt], timeout=30)
            except GlusterError as e:
                last = str(e)
                time.sleep(1.0)
                continue
            self._mounts.append(mnt)
            try:  # a probe with a timeout: never hang on a dead mount
                run(["stat", "-f", "-c", "%T", mnt], timeout=15)
                probe = os.path.join(mnt, f".probe-{os.getpid()}")
                run(["touch", probe], timeout=15)
                run(["rm", "-f", probe], timeout=15)
                return
            except GlusterError as e:
                last = str(e)
                self._umount(mnt)
                time.sleep(1.0)
        raise GlusterError(f"cannot mount {self.host}:/{name} on {mnt}: {last}")

    def _umount(self, mnt: str) -> None:
        try:
            run(["umount", mnt], timeout=20)
        except GlusterError:
            with contextlib.suppress(GlusterError):
                run(["umount", "-l", mnt], timeout=20)
        with contextlib.suppress(ValueError):
            self._mounts.remove(mnt)

    # ------------------------------------------------------------------ teardown
    def close(self) -> list[str]:
        """Tear everything down; returns the problems met (never raises)."""
        problems: list[str] = []
        for mnt in list(self._mounts):
            self._umount(mnt)
        for name in self._vols:
            for step in (("volume", "stop", name, "force"), ("volume", "delete", name)):
                try:
                    gluster(*step, retries=20)
                except GlusterError as e:
                    problems.append(str(e).splitlines()[0])
        self._vols.clear()
        self.volumes.clear()
        self.bricks.clear()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
            self.proc = None
        if self._own_workdir:
            still = [m for m in self._mounts if os.path.ismount(m)]
            if still:  # never walk into a live mount: leave the directory for a human
                problems.append(f"still mounted, {self.workdir} kept: {still}")
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return problems

    def __enter__(self) -> GlusterSession:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
