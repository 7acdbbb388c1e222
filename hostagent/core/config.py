"""Read hostagent's configuration: one TOML file, checked whole before the agent starts.

The agent moves hardware between running VMs, so it refuses to start on a file it does
not fully understand. Every mistake names the file, the key (``owners.gaming1.gpus[1]``),
what is wrong and how to fix it; one `ConfigError` carries every mistake of the file in
its ``problems`` (those that span sections once each section reads), so a single run of
``hostagent check-config`` names them all.

Example (``/etc/hostagent/config.toml``; everything but ``[lendee]`` is optional)::

    libvirt_uri = "qemu:///system"
    hook_socket = "/run/hostagent/hook.sock"
    control_socket = "/run/hostagent/control.sock"
    control_group = "hostagent"             # may use control.sock (mode 0660); default: root only
    control_verbs = ["status", "hold", "resume"]  # what control_group may do (the default)
    state_dir = "/var/lib/hostagent"        # state.toml and spool/ live here
    log_level = "info"                      # hostagent's own: "debug", "warning", "error"

    [lendee]                                # the Kubernetes worker VM that borrows GPUs
    domain = "gpu-node"                     # libvirt domain name
    node = "gpu-node"                       # Kubernetes node name; defaults to domain
    gpus = ["gpu-a", "gpu-b", "gpu-c"]      # every GPU it may borrow: labels or PCI addresses
    min_gpus = 1                            # fewer free than this: the lendee stays off
    cdi_refresh = "systemctl restart nvidia-container-toolkit-cdi-generator"  # run in it
                                            # after a hot-add (its CDI spec); "": none

    [gpus.gpu-a]                            # a label of your choosing
    pci = "0000:01:00.0"                    # the GPU function; every function of its
    functions = ["0000:01:00.1"]            # slot moves with it, listed here or not
    uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000001"  # checked inside the lendee
    name = "RTX 3050"                       # for messages

    [gpus.gpu-b]
    pci = "0000:02:00.0"
    functions = ["0000:02:00.1"]

    [gpus.gpu-c]
    pci = "0000:03:00.0"

    [gpus.gpu-d]                            # by UUID alone: placed where NVML sees it
    uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000004"

    [owners.gaming1]                        # a gaming VM, by libvirt domain name
    gpus = ["gpu-a"]

    [owners.gaming2]
    gpus = ["gpu-b"]
    start_at_boot = false                   # true: started once per host boot, GPUs freed first

    [owners.gaming-win]                     # another VM on gpu-a: owners of a GPU take turns
    gpus = ["gpu-a"]

    [timeouts]                              # durations: "500ms", "90s", "2m", "1h30m"
    guest_agent = "3m"                      # for the lendee's guest agent to answer
    shutdown = "2m"                         # for the lendee to stop after guest-shutdown
    start = "2m"                            # for a VM to start
    drain = "5m"                            # for the node to drain
    ready = "10m"                           # for the node to be Ready with its GPUs

    [policy]
    relend_delay = "30s"                    # quiet time before lending GPUs back
    force_off_after = ""                    # "" = never destroy the lendee (default)
    on_drain_timeout = "proceed"            # or "abort"
    lint_before_start = true                # refuse to start a VM whose XML has errors
    partial = true                          # lend the free GPUs while others play; false:
                                            # the lendee runs only with all of its GPUs
    regrow = "when-idle"                    # add GPUs a game freed (a restart): "when-idle"
                                            # (no GPU pod on the node), "always" or "never"
    regrow_max_wait = ""                    # when-idle restarts anyway after this ("2h");
                                            # "" (default): never, no GPU job is killed
    hotplug = "auto"                        # "add" where lint finds the lendee can (root
                                            # ports, a 64-bit window), "both" once it shows
                                            # it can unplug (plugins pause, drain); else "none";
                                            # "add": attach freed GPUs live, no restart;
                                            # "both" (experimental): also detach a game's GPU
    reserve_lead = "15m"                    # `hostagent reserve`: the GPU pods' notice this
    reserve_margin = "5m"                   # long ahead; eviction at the time less their
    reserve_expiry = "30m"                  # grace and this; unused this long: lent again

    [drain]                                 # the levers of a player's wait: hostagent.core.levers

    [verify]                                # after a lend: does the guest see its GPUs?
    method = "guest-agent"                  # "guest-agent" (guest-exec), "ssh" or "none"
    command = "nvidia-smi"                  # run in the guest (PATH is searched)
    timeout = "2m"                          # keep asking this long: drivers load late

    [verify.ssh]                            # only for method = "ssh"
    host = "gpu-node.lan"
    port = 22
    user = "hostagent"
    key = "/var/lib/hostagent/id_ed25519"
    known_hosts = "/var/lib/hostagent/known_hosts"  # the guest's host key is checked

    [kubernetes]
    kubeconfig = "/etc/rancher/k3s/k3s.yaml"  # default: the client's own lookup
    annotation_prefix = "hostagent.io/"
    gpu_resource = "nvidia.com/gpu"
    gpu_api = "auto"                        # "device-plugin", "dra" (resource.k8s.io/v1),
                                            # or "auto": what the node publishes (the
                                            # driver's ResourceSlices or GPU capacity)
    dra_driver = "gpu.nvidia.com"           # the DRA driver whose slices list the GPUs
    drain_emptydir = true                   # evict pods that use emptyDir volumes
    drain_unmanaged = false                 # evict pods no controller will recreate
    lent_taints = ["hostagent.io/borrowed=true:NoSchedule"]  # while lent; none by default
    evict_retry = "5s"                      # retry an eviction a PodDisruptionBudget refused
    borrowed_label = "hostagent.io/borrowed"  # label "true" while lent; "" for none
    expected = { "nvidia.com/gpu" = 4 }     # per lent GPU; default: read from the node's
                                            # GPU Feature Discovery labels (time-slicing, MIG)
    grace_period = "30s"                    # evicted pods' grace; default: each pod's own
    skip_wait_for_delete_timeout = "10s"    # a pod this long past its deletion counts as gone
    plugin_selectors = ["app=my-gpu-plugin"]  # the GPU plugins' pods, kept off the GPUs for
                                            # a live change; default: NVIDIA's installs' labels
    plugin_labels = ["nvidia.com/gpu.deploy.device-plugin"]  # set "false" meanwhile;
                                            # default: gpu-operator's operands that hold GPUs

    [metrics]                               # Prometheus /metrics and /healthz; off without it
    listen = "127.0.0.1:9477"               # host:port ("[::1]:9477"; ":9477" = every address)

    [ssh]                                   # the home-automation endpoint; off without it
    listen = "0.0.0.0:2222"                 # host:port, or a port number: every address
    host_key = "/var/lib/hostagent/ssh_host_ed25519_key"  # the default; made if missing
    authorized_keys = "/etc/hostagent/authorized_keys"    # each key: verbs="…",vms="…"

    [mqtt]                                  # Home Assistant over MQTT; off without it
    broker = "mqtts://broker.lan:8883"      # mqtt://host[:port] (1883) or mqtts:// (8883)
    ca = "/etc/hostagent/broker-ca.pem"     # mqtts only; default: the system's CAs
    username = "hostagent"
    password_file = "/run/credentials/hostagent.service/mqtt-password"  # the default when
                                            # the unit passes the credential mqtt-password
    discovery_prefix = "homeassistant"
    base_topic = "hostagent/tower"          # states and commands live under it (the
                                            # default: hostagent/<this host's name>)
    verbs = ["play", "release", "reserve"]  # what MQTT may command (default: all)
    vms = ["gaming1"]                       # the owners it may start and stop; default: all
    per_entity = false                      # true: one discovery message per entity

    [notify]                                # a POST before each drain; off without it
    url = "https://hooks.lan/gaming-host"   # http(s), a JSON body: event, node, for, ...
    timeout = "2s"                          # the drain waits this long at most (<= 10s)

Rules beyond the types:

- A GPU reference (in ``lendee.gpus`` or ``owners.*.gpus``) is a label from ``[gpus]``,
  a PCI address, or a UUID (``GPU-…``). The address of a declared GPU means that GPU;
  any other address stands for a GPU with that single function (declare it under
  ``[gpus]`` to move its audio function along); so does any other UUID, by UUID alone.
  Addresses are written ``DDDD:BB:DD.F``; ``BB:DD.F`` means domain 0000. They are kept
  lowercase with the domain.
- A ``[gpus]`` entry has a ``pci`` address, a ``uuid``, or both. One given by UUID alone
  is placed where NVML sees it when the agent starts (`hostagent.host.gpus.resolve_uuids`);
  NVML cannot see a GPU bound to vfio-pci, so passthrough GPUs need ``pci`` (``hostagent
  config init`` writes both). A UUID names one GPU.
- A PCI function belongs to one GPU. A GPU may have several owners (a Windows and a
  Linux gaming VM on one card): they take turns, and a start while another owner holds
  the card is refused at once.
- The lendee is not an owner: it borrows, it does not lend.
- Several worker VMs may borrow, each its own GPUs and node: ``[lendees.NAME]`` sections
  (NAME the domain; `hostagent.core.lendees`). ``[lendee]`` is the lendee named by its
  domain. A GPU belongs to at most one lendee.
- The lendee may borrow a GPU no owner claims: that GPU is simply always the lendee's.
- The lendee's persistent definition lists every GPU it borrows; each boot runs with
  those that are free (``policy.partial``), and only when at least ``lendee.min_gpus``
  are (1 to the number in ``lendee.gpus``).
- ``policy.regrow`` says when the lendee, running with fewer GPUs than it may borrow,
  restarts to add those a game freed: ``"when-idle"`` when no pod on the node requests
  a GPU (without ``[kubernetes]``: as ``"always"``), ``"always"`` after
  ``relend_delay``, ``"never"`` only when it stops for another reason.
  ``policy.regrow_max_wait`` bounds the wait of ``"when-idle"``: after it, the lendee
  restarts and the GPU pods still running start over (``""``, the default: no bound,
  so a regrow never kills a running job).
- ``policy.hotplug = "auto"`` (the default) is ``"add"`` where `hostagent lint` finds the
  lendee's definition can hot-add (a 64-bit window included), ``"both"`` once the running
  lendee shows it can hot-unplug, else ``"none"``; ``status`` and ``lint`` say why.
  ``"add"`` attaches the GPUs a game freed to the running lendee
  (its live definition only) instead of that restart; a hot-add that fails leaves
  them to the regrow (undone as an unplug is). ``"none"``: every change is a restart.
  After a hot-add, ``lendee.cdi_refresh`` runs in the guest before the plugins restart.
  ``"both"`` (experimental) also takes a game's GPU from the running lendee live when
  it keeps ``min_gpus`` without it: only the pods using it are evicted, and a detach
  that fails or is in doubt falls back to the reclaim by restart. NVIDIA does not
  support hot-unplug of its GPUs, and some drivers hang an unbind begun while a
  client holds the GPU: read `hostagent lint` and the driver's release notes first.
- An owner may keep a GPU the lendee does not borrow: hostagent leaves it alone.
- A ``[gpus]`` entry nobody references is allowed and ignored.
- Timeouts must be longer than zero; ``relend_delay``, ``force_off_after`` and
  ``regrow_max_wait`` may be 0.
- ``force_off_after`` is how long after a guest-agent shutdown timed out the lendee is
  destroyed. Unset (or ``""``), it never is.
- Paths must be absolute: the agent's working directory is nobody's business.
- ``verify.method = "ssh"`` needs ``[verify.ssh]``; its ``known_hosts`` is required,
  because a check that trusts any host key proves nothing.
- ``control_group`` is a group name; the agent looks it up when it starts and refuses
  to start if there is no such group. Without it the control socket is root's alone.
- ``control_verbs``: the control verbs members of ``control_group`` may use (default:
  status, hold, resume/lend; ``"reserve:gaming1"``: on one VM; cancel-any); root: all.
- ``[ssh]`` turns the SSH endpoint on (`hostagent.surfaces.ssh`, which documents the
  authorized-keys syntax). Its host key is created (ed25519, mode 0600, with a ``.pub``
  beside it) when the file does not exist; an existing one is never replaced.
- ``[mqtt]`` turns the Home Assistant device on (`hostagent.surfaces.mqtt`,
`hostagent.surfaces.homeassistant`).
  The broker URL carries no user or password: the password is read from
  ``password_file`` (a systemd credential) at each connection. ``mqtt.vms`` lists owners.
- Private keys (``ssh.host_key``, ``verify.ssh.key``) that group or others may read are
  refused, with the fix (``chmod 600``), as OpenSSH refuses them.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import tomllib
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hostagent.core.config_read import (  # the readers of each key
    TOP_LEVEL_KEYS, MQTT_VERBS, LogLevel, _GPU_REFS, _Problem, _READ, _absolute_path,
    _annotation_prefix, _bool, _broker, _build, _canonical_pci, _choice, _control_verbs,
    _duration, _expected, _gather, _group, _join, _key, _label_key,
    _label_key_or_off, _label_selector, _list, _listen, _listen_or_port, _mqtt_verb,
    _optional_duration, _optional_path, _pci, _port, _positive_duration, _raise_any, _section,
    _split_listen, _table_of, _taint, _text, _topic, parse_duration,
)
from hostagent.core.config_notify import Notify
from hostagent.core.lendees import NO_LENDEE, Lendee, link as _link_lendees, read_lendees
from hostagent.core.lendees import view as _view
from hostagent.core.model import Hotplug, Regrow  # the machine's own policy values
from hostagent.core.levers import DrainPolicy, read_drain
from hostagent.core.plugins import PLUGIN_LABELS, PLUGIN_SELECTORS


__all__ = [
    "DEFAULT_PATH", "Config", "ConfigError", "DrainTimeoutAction", "Gpu", "Kubernetes",
    "Lendee", "LogLevel", "Metrics", "Mqtt", "Owner", "Policy", "Hotplug", "Regrow", "Ssh",
    "SshEndpoint", "Timeouts", "Verify", "VerifyMethod", "load", "parse",
    "parse_duration",
]

DEFAULT_PATH = Path("/etc/hostagent/config.toml")


class ConfigError(Exception):
    """A configuration file hostagent cannot use, and what to do about it."""

    def __init__(self, *, source: str, problem: str, fix: str = "", key: str | None = None,
                 line: int | None = None, column: int | None = None) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        self.fix = fix
        self.line = line
        self.column = column
        where = source
        if line is not None:
            where += f":{line}" + (f":{column}" if column is not None else "")
        if key:
            where += f": {key}"
        super().__init__(f"{where}: {problem}" + (f"; {fix}" if fix else ""))
        # Every problem found in one reading, this one first: a file is checked whole,
        # so that one run of check-config names them all.
        self.problems: tuple[ConfigError, ...] = (self,)
        # The configuration as it reads with its bad keys at their defaults, when every
        # section read far enough: check-config still checks it against the host.
        self.salvaged: Config | None = None

    @classmethod
    def several(cls, errors: Sequence[ConfigError]) -> ConfigError:
        """One error that stands for `errors` (at least one): the first's fields, every
        problem in `problems`, one line each in its message."""
        first = errors[0]
        combined = cls(source=first.source, problem=first.problem, fix=first.fix,
                       key=first.key, line=first.line, column=first.column)
        combined.problems = tuple(errors)
        combined.args = ("\n".join(str(e) for e in errors),)
        return combined


# --- the configuration -----------------------------------------------------------------


class DrainTimeoutAction(enum.StrEnum):
    """What to do when the node has not drained within ``timeouts.drain``."""

    PROCEED = "proceed"  # shut the lendee down anyway: the gamer waits no longer
    ABORT = "abort"  # give up: the lendee keeps its GPUs and the owner does not start


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One passthrough GPU: its main PCI function and the functions that move with it."""

    label: str
    # None: given by uuid alone, placed where NVML sees it when the agent starts.
    pci: str | None = field(default=None, metadata=_key(_pci))
    # Other functions that move with it. Every function of its slot does anyway: the
    # agent adds those it finds on the host (`hostagent.host.gpus.on_host`).
    functions: tuple[str, ...] = field(default=(), metadata=_key(_list(_pci)))
    uuid: str | None = field(default=None, metadata=_key(_text))
    name: str | None = field(default=None, metadata=_key(_text))
    # Not a key: the IOMMU groups of its functions, as the host has them (`on_host`).
    iommu_groups: tuple[str, ...] = ()

    @property
    def pci_functions(self) -> tuple[str, ...]:
        """Every PCI function of this GPU, the main one first (if its address is known)."""
        return (self.pci, *self.functions) if self.pci else self.functions

    def __str__(self) -> str:
        return f"{self.label} ({self.name}, {self.pci or self.uuid})" if self.name else self.label


@dataclass(frozen=True, kw_only=True)
class Owner:
    """A gaming VM and the GPUs it must have back before it starts."""

    domain: str
    gpus: tuple[str, ...] = field(metadata=_key(_GPU_REFS, example='["gpu-a"]'))
    # Started by the agent once per host boot (instead of libvirt's autostart, which
    # runs before the agent is up to reclaim its GPUs).
    start_at_boot: bool = field(default=False, metadata=_key(_bool))


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long each step may take, in seconds."""

    # The guest agent takes 30-60 s to come up in a freshly booted VM.
    guest_agent: float = field(default=180.0, metadata=_key(_positive_duration))
    shutdown: float = field(default=120.0, metadata=_key(_positive_duration))
    start: float = field(default=120.0, metadata=_key(_positive_duration))
    drain: float = field(default=300.0, metadata=_key(_positive_duration))
    ready: float = field(default=600.0, metadata=_key(_positive_duration))
    # A hot-unplug's part in the guest, all in all: the GPU's holders gone and its driver
    # letting go. Past it the unplug gives way to the restart, which frees the GPU for sure.
    release: float = field(default=10.0, metadata=_key(_positive_duration))


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Choices an administrator makes; the defaults are the careful ones."""

    relend_delay: float = field(default=30.0, metadata=_key(_duration))
    # None: never destroy. Destroying a booting VM has left a GPU in a power state only a
    # host reboot cured, so forcing is opt-in.
    force_off_after: float | None = field(default=None, metadata=_key(_optional_duration))
    on_drain_timeout: DrainTimeoutAction = field(
        default=DrainTimeoutAction.PROCEED, metadata=_key(_choice(DrainTimeoutAction))
    )
    # Lint a domain's XML against the host before starting it; refuse on errors.
    lint_before_start: bool = field(default=True, metadata=_key(_bool))
    # False: all or nothing, the lendee runs only when every GPU it borrows is free.
    partial: bool = field(default=True, metadata=_key(_bool))
    regrow: Regrow = field(default=Regrow.WHEN_IDLE, metadata=_key(_choice(Regrow)))
    # A when-idle regrow restarts the lendee anyway after this long, killing the GPU jobs
    # that run; None: never. Waiting leaves the freed GPUs idle meanwhile.
    regrow_max_wait: float | None = field(default=None, metadata=_key(_optional_duration))
    # "add": GPUs a game freed are attached to the running lendee, no drain, no restart;
    # "both": an owner's GPUs are detached live too, the restart its fallback; "auto":
    # "both" where lint finds the lendee can, else "none" (every change a restart).
    hotplug: Hotplug = field(default=Hotplug.AUTO, metadata=_key(_choice(Hotplug)))
    # Reservations (hostagent.core.reserve): the notice's lead, the margin for the drain and
    # shutdown after the longest grace, how long an unused one is kept, and then its pause.
    reserve_lead: float = field(default=900.0, metadata=_key(_duration))
    reserve_margin: float = field(default=300.0, metadata=_key(_duration))
    reserve_expiry: float = field(default=1800.0, metadata=_key(_positive_duration))
    reserve_cooldown: float = field(default=3600.0, metadata=_key(_duration))


class VerifyMethod(enum.StrEnum):
    """How the agent asks the lendee which GPUs its driver sees, after a lend."""

    GUEST_AGENT = "guest-agent"  # guest-exec through qemu-ga: nothing else to set up
    SSH = "ssh"  # for guests whose qemu-ga refuses guest-exec
    NONE = "none"  # trust the cluster's nvidia.com/gpu count alone


@dataclass(frozen=True, kw_only=True)
class Ssh:
    """Where and as whom to reach the lendee over SSH; its host key is always checked."""

    host: str = field(metadata=_key(_text, example='"gpu-node.lan"'))
    port: int = field(default=22, metadata=_key(_port))
    user: str = field(metadata=_key(_text, example='"hostagent"'))
    key: Path = field(metadata=_key(_absolute_path, example='"/var/lib/hostagent/id_ed25519"'))
    known_hosts: Path = field(
        metadata=_key(_absolute_path, example='"/var/lib/hostagent/known_hosts"')
    )


@dataclass(frozen=True, kw_only=True)
class Verify:
    """The in-guest check after a lend: the UUIDs nvidia-smi lists in the lendee."""

    method: VerifyMethod = field(
        default=VerifyMethod.GUEST_AGENT, metadata=_key(_choice(VerifyMethod))
    )
    command: str = field(default="nvidia-smi", metadata=_key(_text))
    # The NVIDIA driver may load after the guest agent answers: keep asking this long.
    timeout: float = field(default=120.0, metadata=_key(_positive_duration))
    ssh: Ssh | None = field(default=None, metadata=_key(_section(Ssh)))


class GpuApi(enum.StrEnum):
    """How the cluster hands out GPUs: "device-plugin" (allocatable ``nvidia.com/gpu``),
    "dra" (Dynamic Resource Allocation: devices in ResourceSlices, by UUID), or "auto"
    (decided at each lend from what the cluster serves)."""

    AUTO = "auto"
    DEVICE_PLUGIN = "device-plugin"
    DRA = "dra"


@dataclass(frozen=True, kw_only=True)
class Kubernetes:
    """How to reach the cluster and how to drain the lendee's node."""

    kubeconfig: Path | None = field(default=None, metadata=_key(_optional_path))
    annotation_prefix: str = field(default="hostagent.io/", metadata=_key(_annotation_prefix))
    gpu_resource: str = field(default="nvidia.com/gpu", metadata=_key(_text))
    gpu_api: GpuApi = field(default=GpuApi.AUTO, metadata=_key(_choice(GpuApi)))
    dra_driver: str = field(default="gpu.nvidia.com", metadata=_key(_text))
    drain_emptydir: bool = field(default=True, metadata=_key(_bool))
    drain_unmanaged: bool = field(default=False, metadata=_key(_bool))
    # Put on the node while it is lent, taken off when it is reclaimed: e.g. to keep
    # workloads that cannot be preempted off borrowed capacity.
    lent_taints: tuple[str, ...] = field(default=(), metadata=_key(_list(_taint)))
    # How often an eviction that a PodDisruptionBudget refuses is tried again (kubectl: 5s).
    evict_retry: float = field(default=5.0, metadata=_key(_positive_duration))
    # A label set to "true" while the node is lent (for a Kueue ResourceFlavor or a
    # scheduler to tell borrowed capacity apart); None: no label.
    borrowed_label: str | None = field(default="hostagent.io/borrowed",
                                       metadata=_key(_label_key_or_off))
    # What the node must report allocatable *per lent GPU* before it is uncordoned,
    # e.g. {"nvidia.com/gpu" = 4} for 4 time-slicing replicas or
    # {"nvidia.com/mig-1g.10gb" = 7} for MIG; None: read from the node's labels.
    expected: dict[str, int] | None = field(default=None, metadata=_key(_expected))
    # Grace period given to evicted pods (kubectl drain --grace-period); None: their own.
    grace_period: float | None = field(default=None, metadata=_key(_optional_duration))
    # A pod whose deletion is this far in the past counts as gone: on a node whose
    # kubelet is unreachable it would stay Terminating forever (kubectl drain
    # --skip-wait-for-delete-timeout). "0s": wait for every pod.
    skip_wait_for_delete_timeout: float = field(default=10.0, metadata=_key(_duration))
    # The pods that advertise the node's GPUs, kept off them for a live GPU change (they
    # hold every GPU and enumerate them when they start): label selectors, each listed
    # on the node.
    plugin_selectors: tuple[str, ...] = field(default=PLUGIN_SELECTORS,
                                              metadata=_key(_list(_label_selector)))
    # The node labels set to "false" to keep them, and what else holds the GPUs, off
    # the node meanwhile (hostagent.core.plugins), then restored as they were.
    plugin_labels: tuple[str, ...] = field(default=PLUGIN_LABELS,
                                           metadata=_key(_list(_label_key)))


@dataclass(frozen=True, kw_only=True)
class Metrics:
    """Where to serve Prometheus metrics and /healthz over HTTP; nowhere unless set."""

    # No authentication: keep it on loopback or a trusted network.
    listen: str | None = field(default=None, metadata=_key(_listen))

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to bind, host "" meaning every address; None when off."""
        return None if self.listen is None else _split_listen(self.listen)


@dataclass(frozen=True, kw_only=True)
class SshEndpoint:
    """The SSH endpoint for home automation (`hostagent.surfaces.ssh`); off without [ssh]."""

    listen: str = field(metadata=_key(_listen_or_port, example='"0.0.0.0:2222"'))
    # None: ssh_host_ed25519_key in state_dir (Config.ssh_host_key).
    host_key: Path | None = field(default=None, metadata=_key(_absolute_path))
    authorized_keys: Path = field(
        default=Path("/etc/hostagent/authorized_keys"), metadata=_key(_absolute_path)
    )

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to bind, host "" meaning every address."""
        address = _split_listen(self.listen)
        assert address is not None  # checked when read
        return address


@dataclass(frozen=True, kw_only=True)
class Mqtt:
    """The Home Assistant device over MQTT (`hostagent.surfaces.mqtt`); off without [mqtt]."""

    broker: str = field(metadata=_key(_broker, example='"mqtt://broker.lan"'))
    # mqtts: the CA that signed the broker's certificate; None: the system's.
    ca: Path | None = field(default=None, metadata=_key(_absolute_path))
    username: str | None = field(default=None, metadata=_key(_text))
    # None: $CREDENTIALS_DIRECTORY/mqtt-password when the unit passes that credential.
    password_file: Path | None = field(default=None, metadata=_key(_absolute_path))
    discovery_prefix: str = field(default="homeassistant", metadata=_key(_topic))
    # None: "hostagent/<the host's short name>", so that two hosts on one broker differ.
    base_topic: str | None = field(default=None, metadata=_key(_topic))
    verbs: frozenset[str] = field(default=frozenset(MQTT_VERBS),
                                  metadata=_key(lambda v, k: frozenset(_list(_mqtt_verb)(v, k))))
    # None: every owner; else the owners whose switch may start and stop them.
    vms: tuple[str, ...] | None = field(default=None, metadata=_key(_list(_text)))
    # True: one discovery message per entity (Home Assistant before 2024.11).
    per_entity: bool = field(default=False, metadata=_key(_bool))

    @property
    def tls(self) -> bool:
        return urllib.parse.urlsplit(self.broker).scheme == "mqtts"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of the broker."""
        parts = urllib.parse.urlsplit(self.broker)
        assert parts.hostname is not None  # checked when read
        return parts.hostname, parts.port or (8883 if self.tls else 1883)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole configuration. GPU references are resolved to labels of `gpus`."""

    # The one lendee; with [lendees.*] sections, the first of `lendees`.
    lendee: Lendee = field(default=NO_LENDEE, metadata=_key(_section(Lendee)))
    # Every lendee by name (its domain), [lendee] first (`hostagent.core.lendees`).
    lendees: Mapping[str, Lendee] = field(default_factory=dict, metadata=_key(read_lendees))
    gpus: Mapping[str, Gpu] = field(default_factory=dict, metadata=_key(_table_of(Gpu, "label")))
    owners: Mapping[str, Owner] = field(
        default_factory=dict, metadata=_key(_table_of(Owner, "domain"))
    )
    timeouts: Timeouts = field(default_factory=Timeouts, metadata=_key(_section(Timeouts)))
    policy: Policy = field(default_factory=Policy, metadata=_key(_section(Policy)))
    drain: DrainPolicy = field(default_factory=DrainPolicy, metadata=_key(read_drain))
    # None: no [kubernetes] section, the agent moves GPUs between VMs only.
    kubernetes: Kubernetes | None = field(default=None, metadata=_key(_section(Kubernetes)))
    verify: Verify = field(default_factory=Verify, metadata=_key(_section(Verify)))
    metrics: Metrics = field(default_factory=Metrics, metadata=_key(_section(Metrics)))
    # None: no [ssh] section, no SSH endpoint.
    ssh: SshEndpoint | None = field(default=None, metadata=_key(_section(SshEndpoint)))
    # None: no [mqtt] section, no Home Assistant device.
    mqtt: Mqtt | None = field(default=None, metadata=_key(_section(Mqtt)))
    notify: Notify | None = field(default=None, metadata=_key(_section(Notify)))
    libvirt_uri: str = field(default="qemu:///system", metadata=_key(_text))
    hook_socket: Path = field(
        default=Path("/run/hostagent/hook.sock"), metadata=_key(_absolute_path)
    )
    control_socket: Path = field(
        default=Path("/run/hostagent/control.sock"), metadata=_key(_absolute_path)
    )
    # None: the control socket is root's alone (0600); a group makes it 0660.
    control_group: str | None = field(default=None, metadata=_key(_group))
    # What control_group's members may do on the control socket; root may do everything.
    control_verbs: frozenset[str] = field(
        default=frozenset({"status", "hold", "resume", "lend"}), metadata=_key(_control_verbs)
    )
    state_dir: Path = field(default=Path("/var/lib/hostagent"), metadata=_key(_absolute_path))
    log_level: LogLevel = field(default=LogLevel.INFO, metadata=_key(_choice(LogLevel)))
    source: str = "<config>"  # where it was read from, for messages

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.toml"

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def ssh_host_key(self) -> Path | None:
        """The SSH endpoint's host key file; None when the endpoint is off."""
        if self.ssh is None:
            return None
        return self.ssh.host_key or self.state_dir / "ssh_host_ed25519_key"

    def owners_of(self, gpu: str) -> tuple[str, ...]:
        """The domains that own GPU label `gpu`, in the file's order; () if only the
        lendee uses it."""
        return tuple(o.domain for o in self.owners.values() if gpu in o.gpus)

    def gpus_of(self, domain: str) -> tuple[str, ...]:
        """GPU labels that `domain` (a lendee or an owner) uses; () for any other VM."""
        if domain in self.lendees:
            return self.lendees[domain].gpus
        owner = self.owners.get(domain)
        return owner.gpus if owner else ()

    def shared_gpus(self, owner: str) -> frozenset[str]:
        """The GPUs the lendees must give back before `owner` can start."""
        lent = frozenset().union(*(lendee.gpus for lendee in self.lendees.values()))
        return frozenset(self.gpus_of(owner)) & lent

    def view(self, lendee: str) -> Config:
        """What lendee `lendee`'s machine sees (`hostagent.core.lendees.view`)."""
        return _view(self, lendee)


TOP_LEVEL_KEYS.update(f.name for f in dataclasses.fields(Config) if _READ in f.metadata)


# --- cross-references ------------------------------------------------------------------


def _link(config: Config) -> Config:
    """Check what spans sections, and resolve every GPU reference to a label."""
    gpus = dict(config.gpus)
    holder: dict[str, tuple[str, str]] = {}  # PCI function -> (GPU label, key that set it)
    by_uuid: dict[str, str] = {}  # UUID -> GPU label
    problems: list[_Problem] = []
    for label, gpu in gpus.items():
        if gpu.pci is None and gpu.uuid is None:
            where = _join("gpus", label)
            problems.append(_Problem(
                f"{where}.pci",
                "missing",
                f'add pci = "0000:01:00.0" under [{where}] (see lspci -D), or uuid = '
                '"GPU-..." if NVML on this host sees it (see hostagent gpus)',
            ))
        if gpu.uuid is not None:
            if gpu.uuid in by_uuid:
                problems.append(_Problem(
                    f"{_join('gpus', label)}.uuid",
                    f"{gpu.uuid} is already the UUID of GPU {by_uuid[gpu.uuid]}",
                    "a UUID names one GPU: fix one of them",
                ))
            else:
                by_uuid[gpu.uuid] = label
        keys = [f"{_join('gpus', label)}.pci"] * (gpu.pci is not None) + [
            f"{_join('gpus', label)}.functions[{i}]" for i in range(len(gpu.functions))
        ]
        for address, key in zip(gpu.pci_functions, keys, strict=True):
            if address in holder:
                other, other_key = holder[address]
                problems.append(_Problem(
                    key,
                    f"{address} is already a function of GPU {other} ({other_key})",
                    "a PCI function belongs to one GPU: remove one of them",
                ))
            else:
                holder[address] = (label, key)

    def resolve(ref: str, key: str) -> str:
        if ref in gpus:
            return ref
        if ref.startswith("GPU-"):
            if ref not in by_uuid:
                gpus[ref] = Gpu(label=ref, uuid=ref)
                by_uuid[ref] = ref
            return by_uuid[ref]
        address = _canonical_pci(ref)
        if address is None:
            # Labels often differ by one letter (gpu-a, gpu-b): list them, do not guess.
            fix = f"define it as a [{_join('gpus', ref)}] section"
            if gpus:
                fix += " or use one of: " + ", ".join(gpus)
            raise _Problem(key, f'unknown GPU "{ref}"', fix)
        if address not in holder:
            gpus[address] = Gpu(label=address, pci=address)
            holder[address] = (address, key)
            return address
        label, _ = holder[address]
        if gpus[label].pci != address:
            raise _Problem(
                key,
                f"{address} is not a GPU but another function of GPU {label}",
                f'list "{label}" instead: its functions move with it',
            )
        return label

    def resolve_all(refs: tuple[str, ...], key: str) -> tuple[str, ...]:
        at: dict[str, int] = {}  # label -> where it is first listed
        for i, ref in enumerate(refs):
            with _gather(problems):
                label = resolve(ref, f"{key}[{i}]")
                if label in at:
                    raise _Problem(f"{key}[{i}]",
                                   f"GPU {label} is already listed at {key}[{at[label]}]",
                                   "remove one")
                at[label] = i
        return tuple(at)

    if config.verify.method is VerifyMethod.SSH and config.verify.ssh is None:
        problems.append(_Problem(
            "verify.ssh",
            'missing: verify.method = "ssh" needs it',
            "add a [verify.ssh] section with host, user, key and known_hosts",
        ))
    lendees = _link_lendees(config.lendee, config.lendees, resolve_all, problems)
    owners: dict[str, Owner] = {}
    for domain, owner in config.owners.items():
        key = _join("owners", domain)
        if domain in lendees:
            problems.append(_Problem(
                key,
                f"{domain} is the lendee, and the lendee cannot also own GPUs",
                f"remove [{key}]: the lendee borrows what lendee.gpus lists",
            ))
            continue
        owners[domain] = dataclasses.replace(owner, gpus=resolve_all(owner.gpus, f"{key}.gpus"))
    if config.mqtt is not None and config.mqtt.ca is not None and not config.mqtt.tls:
        problems.append(_Problem("mqtt.ca", "set, but the broker URL is mqtt:// (no TLS)",
                                 "write the broker as mqtts://... or remove ca"))
    listed = [(f"mqtt.vms[{i}]", vm) for i, vm in enumerate(config.mqtt and config.mqtt.vms or ())]
    listed += [("control_verbs", e.split(":")[1]) for e in sorted(config.control_verbs) if ":" in e]
    for key, vm in listed:
        if vm not in owners:
            problems.append(_Problem(
                key, f'"{vm}" is not an owner VM',
                f"list some of {', '.join(owners) or 'the [owners] (none yet)'}"))
    _raise_any(problems)
    lendee = next(iter(lendees.values()))  # there is one, or a problem was raised
    return dataclasses.replace(config, lendee=lendee, lendees=lendees, owners=owners, gpus=gpus)


# --- entry points ----------------------------------------------------------------------

_TOML_POSITION = re.compile(r"\s*\((?:at line (\d+), column (\d+)|at end of document)\)$")


def parse(text: str, source: str = "<config>") -> Config:
    """The configuration in TOML `text`; `source` names it in error messages."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _syntax_error(e, text, source) from None
    try:
        return _link(_build(Config, document, "", source=source))
    except _Problem as p:
        problems = p.each
        if p.salvaged is not None:
            # The sections read, bad keys at their defaults: what spans sections is
            # checked too, so one run names every problem (a key already named once
            # is not named again).
            try:
                _link(p.salvaged)
            except _Problem as q:
                named = {one.key for one in problems}
                problems = problems + [one for one in q.each if one.key not in named and not
                                       any(k.startswith(f"{one.key}.") for k in named)]
        error = ConfigError.several([
            ConfigError(source=source, key=one.key, problem=one.problem, fix=one.fix)
            for one in problems])
        error.salvaged = p.salvaged
        raise error from None


def _syntax_error(error: tomllib.TOMLDecodeError, text: str, source: str) -> ConfigError:
    message = str(error)
    m = _TOML_POSITION.search(message)
    if m is None:
        return ConfigError(source=source, problem=f"not valid TOML: {message}")
    # TOML ends a line at a newline only: str.splitlines would also split at U+2028.
    lines = re.split(r"\r?\n", text)
    if lines[-1] == "":  # the newline that ends the last line begins none
        lines.pop()
    if m.group(1) is None:
        # Something still open when the file ends (a string, a bracket): the last line.
        line = max(len(lines), 1)
        column = len(lines[-1]) + 1 if lines else 1
        where = " at the end of the file"
    else:
        line, column, where = int(m.group(1)), int(m.group(2)), ""
    shown = f' in "{lines[line - 1].strip()}"' if 0 < line <= len(lines) else ""
    return ConfigError(
        source=source,
        line=line,
        column=column,
        problem=f"not valid TOML: {message[: m.start()]}{where}{shown}",
        fix='check quotes, brackets and "key = value" on that line',
    )


def load(path: Path = DEFAULT_PATH) -> Config:
    """The configuration in file `path`."""
    source = str(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            source=source,
            problem="no such file",
            fix="create one with `hostagent config init`, then edit it",
        ) from None
    except OSError as e:
        raise ConfigError(source=source, problem=f"cannot read it: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            source=source,
            line=data.count(b"\n", 0, e.start) + 1,
            column=e.start - data.rfind(b"\n", 0, e.start),
            problem=f"not UTF-8 text (byte {e.start})",
            fix="save the file as UTF-8",
        ) from None
    return parse(text, source)
