"""An idle GPU that is not lent says why in every surface: `hostagent status --json`
(each GPU's ``not_lent``), its text, and the MQTT device (the GPU's attributes; no entity
is added or renamed)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hostagent.core import clock
from hostagent.core.model import Hold, Observed
from hostagent.surfaces import homeassistant as ha
from hostagent.surfaces.follow import format_status

from tests.unit.agents import make_agent
from tests.unit.homeassistant_scaffold import status, surface


async def test_status_json_says_why_each_idle_gpu_is_not_lent(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    agent.apply(Observed(at=clock.now(), lendee_running=False,
                         owners_running=frozenset({"gaming1"})))
    agent.apply(Hold(at=clock.now()))
    gpus = {g["gpu"]: g for g in agent.verbs.status()["gpus"]}
    assert gpus["gpu-a"]["not_lent"] is None  # gaming1 plays on it
    assert gpus["gpu-b"]["not_lent"]["reason"] == "hold"
    assert "hostagent lend" in gpus["gpu-b"]["not_lent"]["words"]
    json.dumps(agent.verbs.status())  # as the control socket sends it


def _data(**not_lent: Any) -> dict[str, Any]:
    return {"lendee": {"domain": "gpu-node", "phase": "off", "reason": None,
                       "since": time.time(), "hold": False},
            "gpus": [{"gpu": "gpu-a", "name": None, "pci": "0000:01:00.0",
                      "owners": ["gaming1"], "holder": "gaming1", "not_lent": None},
                     {"gpu": "gpu-b", "name": None, "pci": "0000:02:00.0", "owners": [],
                      "holder": None, "not_lent": not_lent or None}],
            "intents": [], "relend_in_s": None}


def test_status_text_gives_the_reason_by_its_name_and_words() -> None:
    text = format_status(_data(reason="below-min-gpus",
                               words="1 GPU free, fewer than lendee.min_gpus = 2", until=None))
    assert "gpu-b is not lent (below-min-gpus): 1 GPU free, fewer than lendee.min_gpus = 2" \
        in text.splitlines()
    assert "gpu-a is not lent" not in text
    later = format_status(_data(reason="relend-delay", words="lent once it has passed",
                                until=time.time() + 12.4))
    assert any(line.startswith("gpu-b is not lent (relend-delay): lent once it has passed (in 1")
               for line in later.splitlines())
    # A status from an agent that does not say it (an older one) still reads.
    old = _data()
    del old["gpus"][1]["not_lent"]
    assert "not lent" not in format_status(old)


def test_mqtt_gpu_attributes_carry_the_reason_and_keep_the_entities() -> None:
    s = surface()
    data = status()
    data["gpus"][2] = {**data["gpus"][2], "holder": None,
                       "not_lent": {"reason": "iommu-group", "words": "usb-vm holds it",
                                    "until": None}}
    out = ha.states(s, data, "")
    assert json.loads(out["hostagent/gpu/gpu-c/attributes"]) == {
        "name": None, "owners": [], "pci": "0000:03:00.0",
        "not_lent": "iommu-group", "not_lent_why": "usb-vm holds it"}
    assert out["hostagent/gpu/gpu-c/state"] == "free"
    # A GPU in use has no reason, and its attributes are as before.
    assert json.loads(out["hostagent/gpu/gpu-a/attributes"]) == {
        "name": "RTX 3050", "owners": ["gaming1"], "pci": "0000:01:00.0"}
    assert set(out) == set(ha.states(s, status(), ""))
