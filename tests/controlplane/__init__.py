"""The real Kubernetes control plane for the lab: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler of one release, built from their sources
(`build.sh`, `main.go`: labkube), started on loopback with the lab's own certificates
and torn down with it.

    plane = ControlPlane(root).start()      # a few seconds; .server, .admin (kubeconfig)
    plane.kubectl("get", "nodes")           # the same release's kubectl, as admin
    plane.credential("hostagent", ...)      # a kubeconfig for a user in some groups
    plane.stop()

What a real cluster has and this one has not: kubelets (the lab's stand-in acts for
the lendee's through the API), a container runtime, a network. Authorization is the
real one (Node, RBAC): a test that connects as the agent's ServiceAccount gets the
real 403 for a verb deploy/rbac.yaml does not grant.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.lab.image import shared_cache

__all__ = ["ControlPlane", "binary", "missing"]

HERE = Path(__file__).parent
# Beta gates the DRA tests need, on by name so that a release that changes their
# default changes nothing here.
FEATURE_GATES = "DRADeviceTaints=true,DRAAdminAccess=true"


def missing() -> str | None:
    """Why the control plane cannot be built here, or None."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                               else None)
    if go is None and not _cached().exists():
        return ("Go is not installed: the lab's Kubernetes is built from source "
                "(tests/controlplane/build.sh says which Go)")
    return None


def _cached() -> Path:
    release = next(line.split()[1] for line in (HERE / "go.mod").read_text().splitlines()
                   if line.strip().startswith("k8s.io/kubernetes v"))
    return shared_cache() / f"kube-{release}" / "labkube"


def binary() -> Path:
    """labkube, built once per release (build.sh skips what is cached)."""
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":/usr/local/go/bin"
    out = subprocess.run([str(HERE / "build.sh")], env=env, stdout=subprocess.PIPE,
                         text=True, check=True, timeout=3600)
    return Path(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ControlPlane:
    """One control plane under `root` (certificates, etcd's data, logs, kubeconfigs)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.labkube = Path()
        self.port = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def admin(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    def start(self, timeout: float = 120.0) -> ControlPlane:
        self.labkube = binary()
        self.pki.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        self._run("certs", str(self.pki))
        self.port = _free_port()
        etcd, peer = _free_port(), _free_port()
        self._spawn("etcd", "etcd", "--name", "lab", "--data-dir", str(self.root / "etcd"),
                    "--listen-client-urls", f"http://127.0.0.1:{etcd}",
                    "--advertise-client-urls", f"http://127.0.0.1:{etcd}",
                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                    "--initial-cluster", f"lab=http://127.0.0.1:{peer}",
                    "--unsafe-no-fsync", "--log-level", "warn")
        pki = self.pki
        self._spawn(
            "kube-apiserver", "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd}", "--bind-address=127.0.0.1",
            f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=Node,RBAC",
            f"--feature-gates={FEATURE_GATES}", "--profiling=false",
            "--enable-priority-and-fairness=false")
        self._client("admin", "kubernetes-admin", "system:masters", path=self.admin)
        self._wait_ready(timeout)
        for component, user in (("kube-controller-manager", "system:kube-controller-manager"),
                                ("kube-scheduler", "system:kube-scheduler")):
            kubeconfig = self._client(component, user)
            more = ([f"--service-account-private-key-file={pki / 'sa.key'}",
                     f"--root-ca-file={pki / 'ca.crt'}", "--use-service-account-credentials",
                     # The lab's nodes are stand-ins that really stop: notice soon.
                     "--node-monitor-grace-period=20s"]
                    if component == "kube-controller-manager" else [])
            self._spawn(component, component, f"--kubeconfig={kubeconfig}",
                        f"--authentication-kubeconfig={kubeconfig}",
                        f"--authorization-kubeconfig={kubeconfig}",
                        "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
                        f"--feature-gates={FEATURE_GATES}", *more)
        # Ready once the controller-manager works: it makes each namespace's default
        # ServiceAccount, without which a pod is refused (on a busy machine, seconds
        # after the API server answers).
        self._serviceaccount("default", timeout)
        return self

    def version(self) -> str:
        """What the API server says it is, e.g. "v1.35.4"."""
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        with urllib.request.urlopen(f"{self.server}/version", context=context,
                                    timeout=10) as reply:
            return str(json.load(reply)["gitVersion"])

    def credential(self, name: str, user: str, *groups: str) -> Path:
        """A kubeconfig for `user` in `groups`, by a client certificate of the lab's CA."""
        return self._client(name, user, *groups)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.labkube), "kubectl",
                               f"--kubeconfig={kubeconfig or self.admin}", *args],
                              capture_output=True, text=True, check=check, input=input,
                              timeout=60)

    def get(self, path: str, **params: str) -> Any:
        """GET `path` (with `params` as its query) as the admin, in this process: a wait
        that polls an object costs a round trip, where kubectl costs a Go program's
        start."""
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.server}{path}{query}", context=context,
                                    timeout=30) as reply:
            return json.load(reply)

    def patch(self, path: str, body: dict[str, Any]) -> Any:
        """A JSON merge patch of `path` as the admin, in this process (see `get`)."""
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        request = urllib.request.Request(
            f"{self.server}{path}", data=json.dumps(body).encode(), method="PATCH",
            headers={"Content-Type": "application/merge-patch+json"})
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            return json.load(reply)

    def namespace(self, name: str, timeout: float = 30.0) -> None:
        """Create namespace `name` and wait for its default ServiceAccount, which the
        controller-manager adds a moment later (a pod created before it is refused)."""
        self.kubectl("create", "namespace", name)
        self._serviceaccount(name, timeout)

    def _serviceaccount(self, namespace: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.kubectl("get", "serviceaccount", "default", "-n", namespace,
                           check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no default ServiceAccount in {namespace} within "
                                   f"{timeout:g}s: " + self.log("kube-controller-manager")[-2000:])
            time.sleep(0.1)

    def stop(self) -> None:
        # The API server before etcd, so that neither logs the other's going for long.
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log(self, component: str) -> str:
        return (self.root / "logs" / f"{component}.log").read_text(errors="replace")

    # -- the parts

    def _run(self, *args: str) -> None:
        subprocess.run([str(self.labkube), *args], check=True, capture_output=True, timeout=60)

    def _spawn(self, name: str, *args: str) -> None:
        with (self.root / "logs" / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen([str(self.labkube), *args], stdout=log,
                                                stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)

    def _client(self, name: str, user: str, *groups: str, path: Path | None = None) -> Path:
        self._run("client-cert", str(self.pki), name, user, *groups)
        path = path or self.root / f"{name}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "lab",
            "clusters": [{"name": "lab", "cluster": {
                "server": self.server,
                "certificate-authority": str(self.pki / "ca.crt")}}],
            "users": [{"name": name, "user": {
                "client-certificate": str(self.pki / f"{name}.crt"),
                "client-key": str(self.pki / f"{name}.key")}}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": name}}],
        }, indent=2))
        path.chmod(0o600)
        return path

    def _wait_ready(self, timeout: float) -> None:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): "
                                       + self.log(name)[-2000:])
            try:
                with urllib.request.urlopen(f"{self.server}/readyz", context=context,
                                            timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError as e:
                last = str(e)
            time.sleep(0.2)
        raise TimeoutError(f"kube-apiserver not ready within {timeout:g}s ({last}): "
                           + self.log("kube-apiserver")[-2000:])
