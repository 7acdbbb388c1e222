"""deploy/rbac.yaml and deploy/rbac-node.yaml applied as README says (test_rbac.py, the
DRA lab, the reservation notice, the unit tests of DRA): the node's manifest made for a
node, and the agent's kubeconfig with its ServiceAccount's token."""

from __future__ import annotations

import json
from pathlib import Path

from tests.controlplane import ControlPlane


REPO = Path(__file__).resolve().parents[2]
RBAC = REPO / "deploy" / "rbac.yaml"
NODE_RBAC = REPO / "deploy" / "rbac-node.yaml"  # one host's: @NODE@ is its node's name
NODE = "gpu-node"


def node_rbac(node: str) -> str:
    """deploy/rbac-node.yaml for `node`, as README's sed makes it."""
    return NODE_RBAC.read_text().replace("@NODE@", node)


def agent_kubeconfig(plane: ControlPlane, path: Path, node: str = NODE) -> Path:
    """The agent's kubeconfig as README says to make it: the token of the ServiceAccount
    named after its node."""
    plane.kubectl("apply", "-f", str(RBAC))
    plane.kubectl("apply", "-f", "-", input=node_rbac(node))
    token = plane.kubectl("create", "token", node, "-n", "hostagent",
                          "--duration=1h").stdout.strip()
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "hostagent",
        "clusters": [{"name": "lab", "cluster": {
            "server": plane.server, "certificate-authority": str(plane.pki / "ca.crt")}}],
        "users": [{"name": "hostagent", "user": {"token": token}}],
        "contexts": [{"name": "hostagent", "context": {"cluster": "lab",
                                                        "user": "hostagent"}}]}))
    return path
