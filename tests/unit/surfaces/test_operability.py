"""What an operator reads of a running agent: its version everywhere, a log level, pod
metrics a dashboard can group by namespace, no stale-verification alert at start, and
how long a player waits for a game."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import hostagent
from hostagent import cli
from hostagent.core import config
from hostagent.core.health import Health
from hostagent.core.model import IntentSource, Observed, OwnerStarted, OwnerWants
from hostagent.surfaces import metrics
from hostagent.surfaces.follow import format_status

from tests.unit.metrics_scaffold import MINIMAL, Driver


def test_version_is_the_installed_distributions() -> None:
    import importlib.metadata
    assert hostagent.version() == importlib.metadata.version("hostagent")


def test_hostagent_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"hostagent {hostagent.version()}\n"


def test_build_info_metric_names_the_version() -> None:
    d = Driver()
    assert d.value("hostagent_build_info", version=hostagent.version()) == 1


def test_log_level_is_a_setting_and_debug_is_hostagents_own() -> None:
    assert config.parse(MINIMAL).log_level == "info"
    cfg = config.parse('log_level = "debug"\n' + MINIMAL)
    assert cfg.log_level == "debug"
    with pytest.raises(config.ConfigError, match='log_level: "loud" is not allowed'):
        config.parse('log_level = "loud"\n' + MINIMAL)
    root = logging.getLogger()
    saved = root.level, root.handlers[:], logging.getLogger("hostagent").level
    try:
        cli.log_to_journal(cfg)
        assert logging.getLogger("hostagent.libvirt").isEnabledFor(logging.DEBUG)
        # Libraries' own debug (asyncssh, the Kubernetes client) would flood the journal.
        assert not logging.getLogger("asyncssh").isEnabledFor(logging.DEBUG)
        cli.log_to_journal(config.parse('log_level = "warning"\n' + MINIMAL))
        assert not logging.getLogger("hostagent.libvirt").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        logging.getLogger("hostagent").setLevel(saved[2])


def test_lent_gpu_pod_has_namespace_and_pod_labels() -> None:
    d = Driver()
    d.metrics.lent_gpu_pods({"gpu-a": "ml/train-1,batch/train-1"})
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-a", namespace="ml", pod="train-1") == 1
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-a", namespace="batch",
                   pod="train-1") == 1


def test_no_verification_timestamp_until_one_since_the_start() -> None:
    """0 would read as "last verified in 1970": an alert on its age fires at every start."""
    d = Driver()
    d(Observed, 100.0, lendee_running=False, owners_running=frozenset())
    assert d.value("hostagent_last_verification_timestamp_seconds") is None
    d.lend(100.0)
    assert d.value("hostagent_last_verification_timestamp_seconds") == 110.0


def test_the_players_wait_from_request_to_game_running() -> None:
    d = Driver()
    d(Observed, 100.0, lendee_running=False, owners_running=frozenset())
    d.lend(100.0)
    d(OwnerWants, 200.0, owner="gaming1", intent_id="i1", source=IntentSource.HOOK)
    assert d.value("hostagent_player_wait_seconds_count") == 0
    d(OwnerStarted, 237.0, owner="gaming1")
    assert d.value("hostagent_player_wait_seconds_count") == 1
    assert d.value("hostagent_player_wait_seconds_sum") == 37.0


def test_status_says_the_version() -> None:
    data: dict[str, Any] = {"lendee": {"domain": "gpu-node", "phase": "off", "reason": None, "since": 0,
                       "hold": False},
            "gpus": [], "intents": [], "relend_in_s": None, "health": [],
            "version": "1.2.3"}
    assert format_status(data).endswith("hostagent 1.2.3")


async def test_healthz_says_the_version() -> None:
    server = await metrics.serve(("127.0.0.1", 0), Driver().metrics, Health(max_age=0),
                                 log=logging.getLogger("t"))
    port = server.sockets[0].getsockname()[1]

    def get() -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return bytes(r.read())

    async with server:
        assert json.loads(await asyncio.to_thread(get))["version"] == hostagent.version()


async def test_the_start_record_and_status_json_say_the_version(tmp_path: Path) -> None:
    from tests.unit.agents import make_agent
    agent, _ = make_agent(tmp_path)
    assert agent.recorder.running_line().startswith(f"hostagent {hostagent.version()} is "
                                                    "running: gpu-node ")
    assert agent.verbs.status()["version"] == hostagent.version()


def test_status_says_why_the_node_is_cordoned_ahead() -> None:
    data = {"lendee": {"domain": "gpu-node", "phase": "lent", "reason": None, "since": 0,
                       "hold": False},
            "cluster": {"cordoned_for": "ahead of gaming1's usual hour (Mon 20:00)"},
            "gpus": [], "intents": [], "relend_in_s": None, "health": [], "version": "1"}
    assert ("  its node is cordoned ahead of gaming1's usual hour (Mon 20:00): it takes no "
            "new pod (drain.cordon_ahead)") in format_status(data).splitlines()
