"""`hostagent unmark-node`: what hostagent put on the lendee's node comes off, exactly
that, for an uninstall (README, "Uninstalling")."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hostagent import cli
from hostagent.kube import Kube, Taint
from tests.kubeapi import StandIn, write_kubeconfig
from tests.kubeapi.rules import NODES
from tests.unit.kube_scaffold import FAST

PREFIX = "hostagent.io/"
LENT_TAINT = Taint(key="hostagent.io/borrowed", value="true", effect="NoSchedule")


@pytest.fixture
async def api() -> AsyncIterator[StandIn]:
    async with StandIn() as standin:
        standin.cluster.add_node("gpu-node", gpus=2)
        yield standin


async def lend_marks(kube: Kube) -> None:
    """What a lend leaves: our cordon marker from a reclaim's cordon, the lent taint, the
    borrowed label and our annotations; beside them, the administrator's own."""
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    await kube.annotate("gpu-node", {f"{PREFIX}state": "lent", f"{PREFIX}lent-gpus": "gpu-a",
                                     "example.com/owner": "ops"},
                        labels={"hostagent.io/borrowed": "true", "team": "ml"},
                        add_taints=[LENT_TAINT, Taint(key="dedicated", value="ml")])


def node(api: StandIn) -> Any:
    return api.cluster.node("gpu-node")


async def test_only_what_hostagent_put_there_comes_off(api: StandIn, tmp_path: Path) -> None:
    async with await Kube.connect(write_kubeconfig(tmp_path / "kc", api.url), timing=FAST) as k:
        await lend_marks(k)
        dry = await k.unmark("gpu-node", marker_prefix=PREFIX, label="hostagent.io/borrowed",
                             taints=[LENT_TAINT], dry_run=True)
        assert f"annotation {PREFIX}state=lent" in dry and node(api)["spec"]["unschedulable"]
        removed = await k.unmark("gpu-node", marker_prefix=PREFIX,
                                 label="hostagent.io/borrowed", taints=[LENT_TAINT])
    assert removed == dry
    assert "its cordon (set by hostagent)" in removed
    assert "taint hostagent.io/borrowed:NoSchedule" in removed
    n = node(api)
    assert not any(k.startswith(PREFIX) for k in n["metadata"].get("annotations", {}))
    assert n["metadata"]["annotations"]["example.com/owner"] == "ops"
    assert n["metadata"]["labels"].get("team") == "ml"
    assert "hostagent.io/borrowed" not in n["metadata"]["labels"]
    assert [t["key"] for t in n["spec"].get("taints") or []] == ["dedicated"]
    assert not n["spec"].get("unschedulable")


async def test_an_administrators_cordon_stays(api: StandIn, tmp_path: Path) -> None:
    def cordoned(n: dict[str, Any]) -> dict[str, Any]:
        n["spec"]["unschedulable"] = True  # kubectl cordon: no marker of ours
        return n

    api.cluster.update(NODES, None, "gpu-node", cordoned)
    async with await Kube.connect(write_kubeconfig(tmp_path / "kc", api.url), timing=FAST) as k:
        await k.cordon("gpu-node", marker_prefix=PREFIX)  # someone else's: no marker
        assert await k.unmark("gpu-node", marker_prefix=PREFIX, label=None, taints=[]) == []
    assert node(api)["spec"]["unschedulable"]


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


async def test_the_verb_takes_the_marks_off(api: StandIn, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    kc = write_kubeconfig(tmp_path / "kc", api.url)
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
    assert not node(api)["spec"].get("unschedulable")
    assert [t["key"] for t in node(api)["spec"]["taints"]] == ["dedicated"]
