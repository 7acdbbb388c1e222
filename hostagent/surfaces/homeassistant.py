"""What Home Assistant sees of the host over MQTT, and what it may ask: pure, no I/O.

Topics and payloads come from the configuration and from the data of `hostagent
status`; a command comes from a (topic, payload) pair. `hostagent.surfaces.mqtt` does the
talking. Discovery is device-based (Home Assistant 2024.11 and later): one retained
message on ``<prefix>/device/<id>/config`` holds the device (``dev``), the origin
(``o``) and every entity (``cmps``, each with its platform ``p``), keys abbreviated as
Home Assistant documents them; ``per_entity`` gives one message per entity instead
(``<prefix>/<platform>/<id>/<entity>/config``), for older releases.

Under ``base_topic`` (``<base>``), every state retained:

    <base>/availability               online / offline (the client's last will)
    <base>/owner/<vm>/state, /set     ON / OFF: the VM runs; ON = play, OFF = release
    <base>/owner/<vm>/player          what its player sees (`PLAYER_STATES`): off,
                                      reserved, waiting for the GPU, starting, running
    <base>/owner/<vm>/reserved, /reserve   a text: the time the VM is reserved for
                                      (YYYY-MM-DDTHH:MM, "" for none); HH:MM or a date
                                      and time reserves (hostagent reserve), the word
                                      "cancel" cancels (and only it: an empty message
                                      is a retained one cleared, and does nothing)
    <base>/gpu/<gpu>/state            who holds it: a VM's name, or "free"
    <base>/gpu/<gpu>/attributes       JSON: its name, PCI address and owners; while
                                      idle, why it is not lent: not_lent (the reason's
                                      name) and not_lent_why (in words)
    <base>/lent/state                 ON / OFF: the lendee is lent (verified, uncordoned)
    <base>/phase/state                the lendee's phase (off, booting, ... failed)
    <base>/live_gpus/state            the GPUs of the lendee's live definition, or "none"
    <base>/transition/state           the last transition, in one sentence
    <base>/hold/state, /set           ON / OFF: lending on hold; ON = hold, OFF = lend
    <base>/reclaim/press              PRESS: take the GPUs back from the lendee
    <base>/lend/press                 PRESS: lend again now
    <base>/lendee/<name>/...          several lendees: each after the first has its own
                                      lent, phase, live_gpus, hold (state, set), reclaim
                                      and lend (press), as above; those above are then
                                      the first lendee's, and command it alone

A name that is not a topic level (``+``, ``#``, ``/``, spaces) is slugged; two names
that slug alike get a suffix, so each entity has its own topics.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hostagent.core.config import Config
from hostagent.core.model import Phase

__all__ = ["FORMER_BASE", "MIGRATE", "PLAYER_STATES", "Command", "Refused", "Surface",
           "cleared",
           "collisions", "command", "command_topics", "components", "device_config",
           "entity_configs", "entity_topics", "former", "host_slug", "migrating", "player_state",
           "removals", "reservation",
           "sentence", "stale_entity", "states", "surface"]

ON, OFF, PRESS = "ON", "OFF", "PRESS"
ONLINE, OFFLINE = "online", "offline"
MAX_STATE = 255  # Home Assistant drops a sensor state longer than this
MAX_PAYLOAD = 64  # a command is a word: anything longer is refused unread
MAX_TOPIC = 512
MIGRATE = b'{"migrate_discovery": true}'  # Home Assistant's hand-over of an entity
# Entities of an earlier configuration this device deletes at most (a retained device
# message is anyone's who may publish there: what it lists is not taken on trust).
MAX_REMOVED = 64
# The entity ids `components` makes, whatever the configuration: only those can be an
# earlier configuration's of this device.
_OUR_ID = re.compile(r"(owner|gpu|reserve|player|lent|phase|live_gpus|hold|reclaim|lend)_"
                     r"[A-Za-z0-9_-]{1,52}|"
                     r"lent|phase|live_gpus|"
                     r"transition|hold|reclaim|lend")
# An owner's state as its player sees it, in the order a start goes through them: a
# reservation holds its GPUs, a start waits while the lendee gives them back, libvirt
# starts the VM, the game runs.
PLAYER_STATES = ("off", "reserved", "waiting for the GPU", "starting", "running")
_PLATFORMS = frozenset({"switch", "binary_sensor", "sensor", "text", "button"})
_WHEN = re.compile(r"[0-9][0-9T:+.Z-]{3,31}")  # a reservation's time, checked by the verb


def _slugs(names: Iterable[str]) -> dict[str, str]:
    """slug -> name, each slug a topic level and an object id Home Assistant takes."""
    out: dict[str, str] = {}
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:48] or "_"
        slug, n = base, 2
        while slug in out:
            slug, n = f"{base}_{n}", n + 1
        out[slug] = name
    return out


@dataclass(frozen=True, kw_only=True)
class Surface:
    """What the device shows and takes, fixed by the configuration."""

    prefix: str
    base: str
    node: str  # the device's id: a topic level and the prefix of unique ids
    name: str  # the device's name, of which Home Assistant makes its entities' ids
    version: str
    lendee: str
    owners: Mapping[str, str]  # slug -> owner VM
    gpus: Mapping[str, str]  # slug -> GPU label
    verbs: frozenset[str]
    vms: frozenset[str]  # owners MQTT may start and stop
    per_entity: bool = False
    # Several lendees: the lendees after the first (slug -> lendee), each with its own
    # lent, phase, GPUs, hold, reclaim and lend entities (`lent_<slug>`, ...) under
    # <base>/lendee/<slug>/; the first keeps the ids a single lendee has, so that an
    # upgrade keeps its entities, and its commands then name it (`Command.lendee`).
    others: Mapping[str, str] = field(default_factory=dict)

    def topic(self, *levels: str) -> str:
        return "/".join((self.base, *levels))

    @property
    def availability(self) -> str:
        return self.topic("availability")

    @property
    def device_topic(self) -> str:
        return f"{self.prefix}/device/{self.node}/config"

    @property
    def birth_topic(self) -> str:
        """Home Assistant says "online" here when it (re)starts: discovery again."""
        return f"{self.prefix}/status"

    def commandable(self, vm: str) -> bool:
        return vm in self.vms and bool(self.verbs & {"play", "release"})


FORMER_BASE = "hostagent"  # base_topic's default before it named the host


def host_slug(host: str) -> str:
    """The host's short name as a topic level (and an object id)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", host.split(".")[0]) or "_"


def surface(cfg: Config, *, version: str, host: str = "", base: str | None = None,
            node: str | None = None) -> Surface:
    """The device of `cfg` (which has an [mqtt] section) on `host`; `base`: under that
    base topic instead of the configuration's; `node`: with that device id instead of
    the one the base topic makes (the id kept when the host was renamed)."""
    mqtt = cfg.mqtt
    assert mqtt is not None
    base = base or mqtt.base_topic
    # The default's device keeps the name it always had, and so the ids Home Assistant
    # gave its entities (a second host's get a suffix); a base set by hand is named.
    name = "hostagent" if base in (None, FORMER_BASE) else f"hostagent {base}"
    if base is None:
        if not host:
            raise ValueError("mqtt.base_topic is not set: the host's name makes the default")
        base = f"{FORMER_BASE}/{host_slug(host)}"
    owners = list(cfg.owners)
    node = node or re.sub(r"[^A-Za-z0-9_-]", "_", base)
    lent = set().union(*(lendee.gpus for lendee in cfg.lendees.values()))
    return Surface(prefix=mqtt.discovery_prefix, base=base, node=node, name=name,
                   version=version, lendee=cfg.lendee.domain, owners=_slugs(owners),
                   gpus=_slugs(sorted(lent.union(*(o.gpus for o in cfg.owners.values())))),
                   verbs=mqtt.verbs, vms=frozenset(owners if mqtt.vms is None else mqtt.vms),
                   per_entity=mqtt.per_entity, others=_slugs(list(cfg.lendees)[1:]))


# --- discovery --------------------------------------------------------------------------


def components(s: Surface) -> dict[str, dict[str, Any]]:
    """Entity id -> its discovery config (abbreviated keys, `p` the platform)."""
    cmps: dict[str, dict[str, Any]] = {}

    def add(cid: str, platform: str, name: str, **more: Any) -> None:
        cmps[cid] = {"p": platform, "name": name, "uniq_id": f"{s.node}_{cid}", **more}

    for slug, vm in s.owners.items():
        state = s.topic("owner", slug, "state")
        if s.commandable(vm):
            add(f"owner_{slug}", "switch", vm, stat_t=state, cmd_t=s.topic("owner", slug, "set"),
                pl_on=ON, pl_off=OFF, ic="mdi:gamepad-variant")
        else:
            add(f"owner_{slug}", "binary_sensor", vm, stat_t=state, pl_on=ON, pl_off=OFF,
                dev_cla="running")
    for slug, vm in s.owners.items():
        add(f"player_{slug}", "sensor", f"{vm} state", stat_t=s.topic("owner", slug, "player"),
            dev_cla="enum", ops=list(PLAYER_STATES), ic="mdi:account-clock")
    for slug, label in s.gpus.items():
        add(f"gpu_{slug}", "sensor", f"GPU {label}", stat_t=s.topic("gpu", slug, "state"),
            json_attr_t=s.topic("gpu", slug, "attributes"), ic="mdi:expansion-card")
    add("lent", "binary_sensor", f"{s.lendee} lent", stat_t=s.topic("lent", "state"),
        pl_on=ON, pl_off=OFF, ic="mdi:kubernetes")
    add("phase", "sensor", f"{s.lendee} phase", stat_t=s.topic("phase", "state"),
        dev_cla="enum", ops=[phase.value for phase in Phase])
    add("live_gpus", "sensor", f"{s.lendee} GPUs", stat_t=s.topic("live_gpus", "state"),
        ic="mdi:expansion-card-variant")
    for slug, lendee in s.others.items():
        add(f"lent_{slug}", "binary_sensor", f"{lendee} lent",
            stat_t=s.topic("lendee", slug, "lent", "state"), pl_on=ON, pl_off=OFF,
            ic="mdi:kubernetes")
        add(f"phase_{slug}", "sensor", f"{lendee} phase",
            stat_t=s.topic("lendee", slug, "phase", "state"), dev_cla="enum",
            ops=[phase.value for phase in Phase])
        add(f"live_gpus_{slug}", "sensor", f"{lendee} GPUs",
            stat_t=s.topic("lendee", slug, "live_gpus", "state"),
            ic="mdi:expansion-card-variant")
        _controls(s, add, f"_{slug}", ("lendee", slug), lendee)
    add("transition", "sensor", "Last transition", stat_t=s.topic("transition", "state"),
        ic="mdi:message-text")
    # The first lendee's: named by it where several lend (its ids stay one lendee's).
    _controls(s, add, "", (), s.lendee if s.others else "")
    if "reserve" in s.verbs:
        for slug, vm in s.owners.items():
            if vm in s.vms:  # Home Assistant's MQTT text entity (min 0: "" cancels)
                add(f"reserve_{slug}", "text", f"{vm} reserved for",
                    stat_t=s.topic("owner", slug, "reserved"),
                    cmd_t=s.topic("owner", slug, "reserve"), min=0, max=32,
                    ic="mdi:calendar-clock")
    return cmps


def _controls(s: Surface, add: Any, suffix: str, under: tuple[str, ...], whose: str) -> None:
    """A lendee's hold switch (a sensor where MQTT may not change it), reclaim and lend
    buttons: ids end with `suffix`, topics are under `under`, names say `whose` ("": the
    names one lendee has)."""
    held = s.topic(*under, "hold", "state")
    gpus = f"{whose}'s GPUs" if whose else "GPUs"
    if s.verbs & {"hold", "lend"}:
        add(f"hold{suffix}", "switch", f"{whose} hold lending" if whose else "Hold lending",
            stat_t=held, cmd_t=s.topic(*under, "hold", "set"), pl_on=ON, pl_off=OFF,
            ic="mdi:pause-circle")
    else:
        add(f"hold{suffix}", "binary_sensor",
            f"{whose} lending on hold" if whose else "Lending on hold", stat_t=held,
            pl_on=ON, pl_off=OFF)
    if "reclaim" in s.verbs:
        add(f"reclaim{suffix}", "button", f"Reclaim {gpus}",
            cmd_t=s.topic(*under, "reclaim", "press"), pl_prs=PRESS, ic="mdi:download")
    if "lend" in s.verbs:
        add(f"lend{suffix}", "button", f"Lend {gpus}",
            cmd_t=s.topic(*under, "lend", "press"), pl_prs=PRESS, ic="mdi:upload")


def _device(s: Surface) -> dict[str, Any]:
    return {"ids": [s.node], "name": s.name, "mf": "hostagent", "mdl": "GPU lending host",
            "sw": s.version}


def _origin(s: Surface) -> dict[str, Any]:
    return {"name": "hostagent", "sw": s.version}


def _shared(s: Surface) -> dict[str, Any]:
    return {"avty_t": s.availability, "pl_avail": ONLINE, "pl_not_avail": OFFLINE, "qos": 1}


def device_config(s: Surface, removed: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The device-based discovery message; `removed` (entity id -> platform) are
    entities of an earlier configuration, sent with their platform alone so that Home
    Assistant deletes them."""
    cmps: dict[str, dict[str, Any]] = {cid: {"p": p} for cid, p in (removed or {}).items()}
    cmps.update(components(s))
    payload = {"dev": _device(s), "o": _origin(s), "cmps": cmps, **_shared(s)}
    return s.device_topic, json.dumps(payload, sort_keys=True)


def entity_configs(s: Surface) -> dict[str, str]:
    """Per-entity discovery: topic -> payload, one per entity."""
    out = {}
    for cid, cmp in components(s).items():
        cmp = dict(cmp)
        platform = cmp.pop("p")
        payload = {**cmp, "dev": _device(s), "o": _origin(s), **_shared(s)}
        out[f"{s.prefix}/{platform}/{s.node}/{cid}/config"] = json.dumps(payload, sort_keys=True)
    return out


def removals(s: Surface, retained: object, *, room: int = MAX_REMOVED) -> dict[str, str]:
    """Entities of a retained device message (an earlier configuration's, parsed) that
    this one lacks: entity id -> platform, at most `room`. Only entities this device
    could have made count (an id `components` makes, its platform, its unique id under
    this device's node): anyone allowed to publish there could list thousands. Ones
    already sent as removals are not repeated."""
    cmps = retained.get("cmps") if isinstance(retained, dict) else None
    if not isinstance(cmps, dict) or room <= 0:
        return {}
    current = components(s)
    out: dict[str, str] = {}
    for cid, c in cmps.items():
        if (cid not in current and isinstance(c, dict) and set(c) != {"p"}
                and c.get("p") in _PLATFORMS and isinstance(cid, str)
                and _OUR_ID.fullmatch(cid) and c.get("uniq_id") == f"{s.node}_{cid}"):
            out[cid] = c["p"]
            if len(out) >= room:
                break
    return out


def entity_topics(s: Surface) -> str:
    """The per-entity config topics of this device, as a subscription."""
    return f"{s.prefix}/+/{s.node}/+/config"


def stale_entity(s: Surface, topic: str) -> bool:
    """A retained per-entity config of this device that the configuration no longer has
    (a removed owner, or discovery now device-based): cleared with an empty message."""
    levels = topic.split("/")
    ours = (topic.startswith(f"{s.prefix}/") and len(levels) == len(s.prefix.split("/")) + 4
            and levels[-3] == s.node and levels[-1] == "config")
    return ours and topic not in (entity_configs(s) if s.per_entity else {})


def migrating(s: Surface, topic: str) -> bool:
    """A per-entity config of an entity that device discovery has too: handed over with
    `MIGRATE` before it is cleared (Home Assistant's migration to device discovery)."""
    return not s.per_entity and topic.split("/")[-2] in components(s)


# --- states -----------------------------------------------------------------------------


def _onoff(value: object) -> str:
    return ON if value else OFF


def _short(text: str) -> str:
    return text if len(text) <= MAX_STATE else text[:MAX_STATE - 1] + "…"


def states(s: Surface, status: Mapping[str, Any], transition: str) -> dict[str, str]:
    """Topic -> retained payload, from `hostagent status`'s data and the last sentence."""
    lendee = status["lendee"]
    running = status.get("owners", {})
    # A start that waits (for a reclaim) is ON already: the switch pressed on stays on.
    waiting = {i.get("owner") for i in status.get("intents", ())}
    holders = {g["gpu"]: g for g in status.get("gpus", ())}
    out = {s.topic("owner", slug, "state"): _onoff(running.get(vm) or vm in waiting)
           for slug, vm in s.owners.items()}
    for slug, label in s.gpus.items():
        gpu = holders.get(label, {})
        out[s.topic("gpu", slug, "state")] = _short(gpu.get("holder") or "free")
        attributes = {"name": gpu.get("name"), "pci": gpu.get("pci"),
                      "owners": gpu.get("owners", [])}
        why = gpu.get("not_lent")
        if why:  # idle, and why it is not lent (`hostagent.core.idle`)
            attributes |= {"not_lent": why.get("reason"), "not_lent_why": why.get("words")}
        out[s.topic("gpu", slug, "attributes")] = json.dumps(attributes, sort_keys=True)
    out[s.topic("lent", "state")] = _onoff(lendee["phase"] == Phase.LENT.value)
    out[s.topic("phase", "state")] = lendee["phase"]
    out[s.topic("live_gpus", "state")] = _short(", ".join(lendee["lent"]) or "none")
    out[s.topic("transition", "state")] = _short(transition or "")
    out[s.topic("hold", "state")] = _onoff(lendee["hold"])
    each = {other["domain"]: other for other in status.get("lendees", ())}
    for slug, name in s.others.items():
        other = each.get(name, {"phase": "off", "lent": []})
        out[s.topic("lendee", slug, "lent", "state")] = _onoff(other["phase"] == Phase.LENT.value)
        out[s.topic("lendee", slug, "phase", "state")] = other["phase"]
        out[s.topic("lendee", slug, "live_gpus", "state")] = _short(
            ", ".join(other["lent"]) or "none")
        out[s.topic("lendee", slug, "hold", "state")] = _onoff(other.get("hold"))
    reserved = {r.get("vm"): r.get("at") for r in status.get("reservations", ())}
    for slug, vm in s.owners.items():
        out[s.topic("owner", slug, "player")] = player_state(vm, status)
    for slug, vm in s.owners.items():
        at = reserved.get(vm)
        out[s.topic("owner", slug, "reserved")] = datetime.fromtimestamp(at).strftime(
            "%Y-%m-%dT%H:%M") if isinstance(at, (int, float)) else ""
    return out


def player_state(vm: str, status: Mapping[str, Any]) -> str:
    """`vm`'s state among `PLAYER_STATES`, from `hostagent status`'s data."""
    if status.get("owners", {}).get(vm):
        return "running"
    if vm in status.get("starting", ()):
        return "starting"
    if any(i.get("owner") == vm for i in status.get("intents", ())):
        return "waiting for the GPU"
    if any(r.get("vm") == vm and r.get("holding") for r in status.get("reservations", ())):
        return "reserved"
    return "off"


def sentence(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str | None:
    """What changed among the owners between two statuses, in words (None: nothing).
    The lendee's phases and the intents have their own sentences (the journal's)."""
    if old is None:
        return None
    said = [f"{vm} is running" if on else f"{vm} stopped"
            for vm, on in new.get("owners", {}).items() if old.get("owners", {}).get(vm) != on]
    return "; ".join(said) or None


# --- commands ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    verb: str
    vm: str | None = None
    at: str | None = None  # reserve's time; "" cancels
    lendee: str | None = None  # several lendees: the one hold, reclaim or lend is for

    @property
    def args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"vm": self.vm} if self.vm else {}
        if self.verb == "reserve":
            args |= {"at": self.at} if self.at else {"cancel": True}
        if self.lendee is not None:
            args["lendee"] = self.lendee
        return args

    def __str__(self) -> str:
        words = [self.verb, *([self.vm] if self.vm else [])]
        if self.verb == "reserve":
            words.append(self.at or "cancel")
        if self.lendee is not None:
            words += ["--lendee", self.lendee]
        return " ".join(words)


@dataclass(frozen=True)
class Refused:
    why: str


def command_topics(s: Surface) -> list[str]:
    """What the client subscribes to for commands."""
    topics = [s.topic("owner", "+", "set"), s.topic("owner", "+", "reserve"),
              s.topic("hold", "set"), s.topic("reclaim", "press"), s.topic("lend", "press")]
    if s.others:
        topics += [s.topic("lendee", "+", "hold", "set"), s.topic("lendee", "+", "reclaim",
                                                                  "press"),
                   s.topic("lendee", "+", "lend", "press")]
    return topics


def command(s: Surface, topic: str, payload: bytes) -> Command | Refused:
    """The verb a message asks for, or why it is refused (with the payload shown safely)."""
    if len(payload) > MAX_PAYLOAD:
        return Refused(f"a {len(payload)}-byte payload on {topic[:MAX_TOPIC]} (at most "
                       f"{MAX_PAYLOAD})")
    word = payload.decode("utf-8", "replace").strip()
    shown = json.dumps(word[:MAX_PAYLOAD])
    levels = topic.split("/")[len(s.base.split("/")):] if topic.startswith(s.base + "/") else []
    wanted: dict[str, str] = {}
    vm = None
    # Several lendees: the topics of one lendee name the first, <base>/lendee/<slug>/
    # the others (`Surface.others`).
    lendee = s.lendee if s.others else None
    if levels[:1] == ["lendee"] and len(levels) == 4 and levels[1] in s.others and \
            levels[2] in ("hold", "reclaim", "lend"):
        lendee, levels = s.others[levels[1]], levels[2:]
    elif levels[:1] == ["lendee"]:
        levels = []  # no lendee of this device: commands nothing
    match levels:
        case ["owner", slug, "set"] if slug in s.owners:
            vm = s.owners[slug]
            wanted = {ON: "play", OFF: "release"}
        case ["owner", slug, "reserve"] if slug in s.owners:
            vm = s.owners[slug]
            if "reserve" not in s.verbs or vm not in s.vms:
                return Refused(f"reserve {vm} on {topic}: mqtt.verbs or mqtt.vms does not "
                               "allow it")
            if not reservation(word):
                return Refused(f"{shown} on {topic}: expected HH:MM, a date and time "
                               "(2026-12-04T20:00), or the word cancel")
            return Command("reserve", vm, "" if word == "cancel" else word)
        case ["hold", "set"]:
            wanted = {ON: "hold", OFF: "lend"}
        case ["reclaim", "press"]:
            wanted = {PRESS: "reclaim"}
        case ["lend", "press"]:
            wanted = {PRESS: "lend"}
        case _:
            return Refused(f"{shown} on {topic[:MAX_TOPIC]}, which commands nothing")
    verb = wanted.get(word)
    if verb is None:
        return Refused(f"{shown} on {topic}: expected {' or '.join(wanted)}")
    if verb not in s.verbs:
        return Refused(f"{verb} on {topic}: mqtt.verbs does not allow it")
    if vm is not None and vm not in s.vms:
        return Refused(f"{verb} {vm} on {topic}: mqtt.vms does not list {vm}")
    return Command(verb, vm, lendee=None if vm is not None else lendee)


def former(cfg: Config, *, version: str) -> Surface | None:
    """The device as the default base_topic made it before it named the host, when the
    configuration leaves base_topic to its default: its retained discovery and states
    are cleared, so that Home Assistant drops that device's entities before this one
    comes (and gives its entities the ids the old ones had)."""
    mqtt = cfg.mqtt
    if mqtt is None or mqtt.base_topic is not None:
        return None
    return surface(cfg, version=version, base=FORMER_BASE)


def cleared(old: Surface, status: Mapping[str, Any]) -> dict[str, str]:
    """Topic -> "" (a retained message deleted) for all that `old` published."""
    topics = [old.device_topic, *entity_configs(old), old.availability,
              *states(old, status, "")]
    return dict.fromkeys(topics, "")


def reservation(word: str) -> bool:
    """The word of a reservation command: a time (the verb reads it), or "cancel" to
    cancel. Nothing is no command: clearing a retained message sends an empty one."""
    return word == "cancel" or bool(_WHEN.fullmatch(word))


def collisions(cfg: Config, *, host: str) -> list[str]:
    """What in [mqtt] would make this host collide with another on the broker, or with
    Home Assistant's own topics (`hostagent check-config` warns)."""
    mqtt = cfg.mqtt
    if mqtt is None:
        return []
    out = []
    prefix, slug = mqtt.discovery_prefix, host_slug(host)
    base = surface(cfg, version="", host=host).base
    node = re.sub(r"[^A-Za-z0-9_-]", "_", base)
    if slug not in base.split("/"):
        out.append(f'mqtt.base_topic = "{base}" does not name this host ({slug}): a second '
                   "host on the same broker with the same base_topic has the same device id "
                   f'({node}) and topics, so Home Assistant merges their entities and '
                   "each takes the other's commands. Fix: leave "
                   f'base_topic out (its default is "{FORMER_BASE}/{slug}").')
    if base == prefix or base.startswith(prefix + "/") or prefix.startswith(base + "/"):
        out.append(f'mqtt.base_topic = "{base}" and mqtt.discovery_prefix = "{prefix}" '
                   "overlap: the agent's states and commands would be read as discovery "
                   "messages. Fix: a base_topic outside the discovery prefix.")
    return out
