"""`hostagent unmark-node`: what hostagent put on the lendee's node comes off, exactly
that, for an uninstall (README, "Uninstalling"). Against the real kube-apiserver, whose
node lifecycle controller keeps taints of its own (node.kubernetes.io/) beside them."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hostagent import cli
from hostagent.cluster.kube import Kube, Taint
from tests.controlplane import ControlPlane
from tests.unit.kube_scaffold import FAST, Api, real_api

PREFIX = "hostagent.io/"
LENT_TAINT = Taint(key="hostagent.io/borrowed", value="true", effect="NoSchedule")


@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    async with real_api(plane) as api:
        await api.seed.node("gpu-node", gpus=2)
        yield api


async def lend_marks(kube: Kube) -> None:
    """What a lend leaves: our cordon marker from a reclaim's cordon, the lent taint, the
    borrowed label and our annotations; beside them, the administrator's own."""
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    await kube.annotate("gpu-node", {f"{PREFIX}state": "lent", f"{PREFIX}lent-gpus": "gpu-a",
                                     "example.com/owner": "ops"},
                        labels={"hostagent.io/borrowed": "true", "team": "ml"},
                        add_taints=[LENT_TAINT, Taint(key="dedicated", value="ml")])


async def node(api: Api) -> Any:
    return await api.seed.get_node("gpu-node")


def taints(n: Any) -> list[str]:
    """The node's taints but the node lifecycle controller's."""
    return [t["key"] for t in n["spec"].get("taints") or []
            if not t["key"].startswith("node.kubernetes.io/")]


async def test_only_what_hostagent_put_there_comes_off(api: Api, tmp_path: Path) -> None:
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=FAST) as k:
        await lend_marks(k)
        dry = await k.unmark("gpu-node", marker_prefix=PREFIX, label="hostagent.io/borrowed",
                             taints=[LENT_TAINT], dry_run=True)
        assert f"annotation {PREFIX}state=lent" in dry
        assert (await node(api))["spec"]["unschedulable"]
        removed = await k.unmark("gpu-node", marker_prefix=PREFIX,
                                 label="hostagent.io/borrowed", taints=[LENT_TAINT])
    assert removed == dry
    assert "its cordon (set by hostagent)" in removed
    assert "taint hostagent.io/borrowed:NoSchedule" in removed
    n = await node(api)
    assert not any(k.startswith(PREFIX) for k in n["metadata"].get("annotations", {}))
    assert n["metadata"]["annotations"]["example.com/owner"] == "ops"
    assert n["metadata"]["labels"].get("team") == "ml"
    assert "hostagent.io/borrowed" not in n["metadata"]["labels"]
    assert taints(n) == ["dedicated"]
    assert not n["spec"].get("unschedulable")


async def test_an_administrators_cordon_stays(api: Api, tmp_path: Path) -> None:
    await api.seed.patch_node("gpu-node", {"spec": {"unschedulable": True}})  # kubectl cordon
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=FAST) as k:
        await k.cordon("gpu-node", marker_prefix=PREFIX)  # someone else's: no marker
        assert await k.unmark("gpu-node", marker_prefix=PREFIX, label=None, taints=[]) == []
    assert (await node(api))["spec"]["unschedulable"]


def test_the_verb_refuses_while_the_agent_runs_and_without_kubernetes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n')
    assert cli.main(["--config", str(path), "unmark-node"]) == 2
    assert "no [kubernetes] section" in capsys.readouterr().err
    # An agent answering on its control socket would mark the node again.
    sock = tmp_path / "control.sock"
    path.write_text(f'control_socket = "{sock}"\n' + path.read_text()
                    + f'[kubernetes]\nkubeconfig = "{tmp_path}/kc"\n')
    (tmp_path / "kc").write_text("")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sock))
        server.listen()

        def answer() -> None:
            conn, _ = server.accept()
            conn.close()

        agent = threading.Thread(target=answer)
        agent.start()
        assert cli.main(["--config", str(path), "unmark-node"]) == 1
        agent.join()
    assert "the agent is running" in capsys.readouterr().err


async def test_the_verb_takes_the_marks_off(api: Api, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    kc = api.write_kubeconfig(tmp_path / "kc")
    async with await Kube.connect(kc, timing=FAST) as k:
        await lend_marks(k)
    path = tmp_path / "config.toml"
    path.write_text(f'control_socket = "{tmp_path}/control.sock"\n'
                    '[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'
                    f'[kubernetes]\nkubeconfig = "{kc}"\n'
                    'lent_taints = ["hostagent.io/borrowed=true:NoSchedule"]\n')
    code = await asyncio.to_thread(cli.main, ["--config", str(path), "unmark-node"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gpu-node: took off its cordon (set by hostagent)" in out
    n = await node(api)
    assert not n["spec"].get("unschedulable")
    assert taints(n) == ["dedicated"]


async def test_the_kubeconfig_may_be_given_once_the_units_credential_is_gone(
        api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NixOS's module points the configuration at the unit's credential
    (/run/credentials/hostagent.service/kubeconfig), which systemd removes once the unit
    stops: README's uninstall (stop, then unmark-node) could not reach the cluster.
    --kubeconfig names the file the credential came from (kubeconfigFile)."""
    kc = api.write_kubeconfig(tmp_path / "kc")
    async with await Kube.connect(kc, timing=FAST) as k:
        await lend_marks(k)
    gone = tmp_path / "credentials" / "hostagent.service" / "kubeconfig"
    path = tmp_path / "config.toml"
    path.write_text(f'control_socket = "{tmp_path}/control.sock"\n'
                    '[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'
                    f'[kubernetes]\nkubeconfig = "{gone}"\n')
    code = await asyncio.to_thread(cli.main, ["--config", str(path), "unmark-node"])
    err = capsys.readouterr().err
    assert code == 1
    assert str(gone) in err and "--kubeconfig" in err, err
    code = await asyncio.to_thread(cli.main, ["--config", str(path), "unmark-node",
                                              "--kubeconfig", str(kc)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gpu-node: took off its cordon (set by hostagent)" in out
    assert not (await node(api))["spec"].get("unschedulable")


async def test_the_verb_takes_the_marks_off_every_lendees_node(
        api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await api.seed.node("gpu-node-b", gpus=1)
    kc = api.write_kubeconfig(tmp_path / "kc")
    async with await Kube.connect(kc, timing=FAST) as k:
        await lend_marks(k)
        await k.cordon("gpu-node-b", marker_prefix=PREFIX)
    path = tmp_path / "config.toml"
    path.write_text(f'control_socket = "{tmp_path}/control.sock"\n'
                    '[lendees.gpu-node]\ngpus = ["0000:01:00.0"]\n'
                    f'[lendees.gpu-node-b]\ngpus = ["0000:02:00.0"]\nkubeconfig = "{kc}"\n'
                    f'[kubernetes]\nkubeconfig = "{kc}"\n')
    code = await asyncio.to_thread(cli.main, ["--config", str(path), "unmark-node"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gpu-node: took off its cordon (set by hostagent)" in out
    assert "gpu-node-b: took off its cordon (set by hostagent)" in out
    assert not (await api.seed.get_node("gpu-node-b"))["spec"].get("unschedulable")
