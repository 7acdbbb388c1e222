"""`hostagent …`: the service (`run`) and the commands that talk to it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hostagent
from hostagent.core import config as configuration
from hostagent.host import journal
from hostagent.surfaces.control import ControlError, request
from hostagent.surfaces.follow import format_status
from hostagent.core.text import clean

if TYPE_CHECKING:
    from hostagent.host import lint


# The exit statuses of every command, in `hostagent --help` and README.
EXIT_STATUSES = (
    (0, "done"),
    (1, "failed: the agent refused or a step failed, lint found errors, no GPU found, the "
        "agent is not running"),
    (2, "a problem with the command line, the configuration or an input file; nothing done"),
    (3, "stopped waiting (--timeout): the agent goes on"),
    (130, "interrupted (Ctrl-C): the agent goes on"),
)

# What each command does, and an example: the first line is its summary in `--help`.
_COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run the agent (what the systemd unit starts)",
            "hostagent run                    # as systemd/hostagent.service does"),
    "status": ("each GPU, its owner and holder; the lendee; intents",
               "hostagent status --json | jq .phase"),
    "hold": ("lend no more: a running lendee keeps running, a stopped one stays off until "
             "`resume`", "hostagent hold                   # before maintenance"),
    "resume": ("lend again (and retry a step that failed)", "hostagent resume"),
    "play": ("start an owner VM (its GPUs are taken back first) and wait until it runs",
             "hostagent play gaming1 --timeout 300"),
    "release": ("shut an owner VM down (guest agent, else ACPI) and wait until it is off; "
                "the lend follows by itself", "hostagent release gaming1"),
    "lend": ("the same as resume: lend the GPUs again now", "hostagent lend"),
    "reclaim": ("take the GPUs back from the lendee with no VM starting; it stays off until "
                "`lend`", "hostagent reclaim && virsh list"),
    "reserve": ("say when you will play an owner VM: its GPUs are taken back gently ahead "
                "(the pods told, with their grace period) and free at that time; unused, "
                "the reservation expires", "hostagent reserve gaming1 --at 20:00"),
    "check-config": ("read the configuration and report every problem",
                     "hostagent --config /etc/hostagent/config.toml check-config"),
    "history": ("the transitions in the journal, and how long each GPU was lent, gaming or "
                "idle", 'hostagent history --since "7 days ago" --svg week.svg'),
    "gpus": ("this host's GPUs: NVML (index, UUID, PCI) and sysfs", "hostagent gpus --json"),
    "lint": ("check domain XML against this host and the configuration",
             "hostagent lint gaming1 gpu-node"),
    "unmark-node": ("take off the lendee's node exactly what hostagent put there (its "
                    "annotations, the borrowed label, the lent taints, its own cordon); the "
                    "agent must be stopped", "hostagent unmark-node --dry-run"),
    "config": ("configuration helpers: `config init` writes a first configuration",
               "hostagent config init --output -"),
    "init": ("write a starter configuration from the domains' `<hostdev>` entries",
             "hostagent config init --lendee gpu-node"),
}


def _command(sub: Any, name: str) -> argparse.ArgumentParser:
    what, example = _COMMANDS[name]
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=what, description=what[0].upper() + what[1:] + ".",
        epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)
    # --config after the command too ("hostagent status --config FILE"); SUPPRESS keeps
    # the one given before the command when none is given after it.
    p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _parser() -> argparse.ArgumentParser:
    statuses = "\n".join(f"  {code:<4} {what}" for code, what in EXIT_STATUSES)
    p = argparse.ArgumentParser(
        prog="hostagent", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=("Lend idle passthrough GPUs to a Kubernetes worker VM; give each back "
                     "when its gaming VM starts."),
        epilog=f"exit status:\n{statuses}\n\n`hostagent COMMAND --help` says more of each.")
    p.add_argument("--config", type=Path, default=configuration.DEFAULT_PATH,
                   help=f"configuration file (default {configuration.DEFAULT_PATH}); also "
                        "accepted after the command")
    p.add_argument("--version", action="version", version=f"hostagent {hostagent.version()}")
    # Where the host's PCI devices are read (tests and the lab point it at a fake tree).
    p.add_argument("--sysfs", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(sub, "run")
    st = _command(sub, "status")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    on_one = ("with several lendees: this one alone (its domain, lendees.NAME); "
              "default: every lendee")
    _command(sub, "hold").add_argument("--lendee", metavar="NAME", help=on_one)
    _command(sub, "resume").add_argument("--lendee", metavar="NAME", help=on_one)
    for verb in ("play", "release"):
        pl = _command(sub, verb)
        pl.add_argument("vm", metavar="VM", help="an owner VM (owners.* in the configuration)")
        _following(pl)
    _command(sub, "lend").add_argument("--lendee", metavar="NAME", help=on_one)
    reclaim = _command(sub, "reclaim")
    reclaim.add_argument("--lendee", metavar="NAME", help=on_one)
    _following(reclaim)
    rs = _command(sub, "reserve")
    rs.add_argument("vm", metavar="VM", help="an owner VM (owners.* in the configuration)")
    when = rs.add_mutually_exclusive_group(required=True)
    when.add_argument("--at", metavar="TIME", help=(
        "HH:MM (the next time the clock shows it) or a date and time, 2026-12-04T20:00"))
    when.add_argument("--cancel", action="store_true", help="drop its reservation")
    rs.add_argument("--every", metavar="DAYS", help=(
        "with --at HH:MM, again and again: daily, weekdays, weekends or mon,wed,fri"))
    rs.add_argument("--all", action="store_true",
                    help="with --cancel: the whole series, not only its next occurrence")
    rs.add_argument("--json", action="store_true", help="machine-readable output")
    _command(sub, "check-config")
    hi = _command(sub, "history")
    hi.add_argument("--since", metavar="WHEN", help=(
        'as journalctl takes it: "1h ago", "today", "2025-01-31 20:00", "@UNIXTIME"'))
    hi.add_argument("--until", metavar="WHEN", help="as journalctl takes it (default: now)")
    hi.add_argument("--json", action="store_true", help="machine-readable output")
    hi.add_argument("--svg", type=Path, metavar="FILE", help=(
        "also draw a timeline: one row per GPU, coloured by holder, swaps marked"))
    hi.add_argument("-D", "--journal-dir", type=Path, metavar="DIR",
                    help="read the journal files in DIR (as journalctl -D)")
    hi.add_argument("--unit", metavar="UNIT", help=(
        "the service's systemd unit: only root's records from it count "
        "(default hostagent.service)"))
    gp = _command(sub, "gpus")
    gp.add_argument("--json", action="store_true", help="machine-readable output")
    gp.add_argument("--sysfs", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    li = _command(sub, "lint")
    li.add_argument("domains", nargs="*", metavar="DOMAIN",
                    help="libvirt domains to check (default: every defined one)")
    li.add_argument("--xml", type=Path, action="append", default=[], metavar="FILE",
                    help="check this domain XML file instead of asking libvirt (repeatable)")
    li.add_argument("--connect", metavar="URI", help="libvirt URI (default: the config's)")
    li.add_argument("--sysfs", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    un = _command(sub, "unmark-node")
    un.add_argument("--dry-run", action="store_true", help="say what it would take off")
    un.add_argument("--kubeconfig", type=Path, metavar="PATH",
                    help="the cluster's kubeconfig, instead of the configuration's (NixOS: "
                         "the unit's credential is gone once it stops; give kubeconfigFile)")
    cf = _command(sub, "config")
    cf_sub = cf.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    ini = _command(cf_sub, "init")
    ini.add_argument("--output", metavar="PATH",
                     help="where to write it (default: the --config path; - for stdout)")
    ini.add_argument("--force", action="store_true", help="overwrite an existing file")
    ini.add_argument("--lendee", metavar="DOMAIN", help=(
        "the Kubernetes worker VM (default: the domain that holds the most GPUs)"))
    ini.add_argument("--connect", metavar="URI", default="qemu:///system",
                     help="libvirt URI (default qemu:///system)")
    ini.add_argument("--xml", type=Path, action="append", default=[], metavar="FILE",
                     help="read domain XML files instead of asking libvirt (repeatable)")
    ini.add_argument("--sysfs", type=Path, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _following(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the agent's progress events as JSON lines")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help=(
        "stop waiting after this long (exit status 3); the agent goes on regardless"))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "reserve" and (args.all and not args.cancel or args.every and args.cancel):
        parser.error("reserve: --every goes with --at, --all with --cancel")
    # These work before there is a configuration (config init writes the first one).
    if args.command == "gpus":
        return _gpus(args)
    if args.command == "config":
        return _config_init(args)
    if args.command == "lint":
        return _lint(args)
    if args.command == "history":  # the journal is enough
        return _history(args)
    try:
        cfg = configuration.load(args.config)
        if args.command == "run":
            cfg = _placed(cfg, args.sysfs)
    except configuration.ConfigError as e:
        _config_problems(e)
        if args.command == "check-config" and e.salvaged is not None:
            for warning in path_warnings(e.salvaged):  # one run names every problem
                print(f"hostagent: warning: {warning}", file=sys.stderr)
        return 2
    if args.command == "unmark-node":
        return _unmark_node(cfg, dry_run=args.dry_run, kubeconfig=args.kubeconfig)
    if args.command == "check-config":
        print(f"{args.config}: OK ({len(cfg.gpus)} GPUs, {len(cfg.owners)} owners, "
              f"lendee{'s' * (len(cfg.lendees) > 1)} {', '.join(cfg.lendees)})")
        from hostagent.surfaces.homeassistant import collisions
        for warning in (path_warnings(cfg) + collisions(cfg, host=socket.gethostname())
                        + host_warnings(cfg)):
            print(f"hostagent: warning: {warning}", file=sys.stderr)
        return 0
    if args.command == "run":
        log_to_journal(cfg)
        from hostagent.service import main as service  # libvirt and friends only where needed
        return service.run(cfg)
    if args.command in ("play", "release", "reclaim"):
        from hostagent.surfaces.follow import follow
        return follow(cfg.control_socket, args.command,
                      {"vm": args.vm} if args.command != "reclaim" else _lendee_arg(args),
                      json_lines=args.json, timeout=args.timeout)
    verb_args = _reserve_args(args) if args.command == "reserve" else _lendee_arg(args)
    try:
        reply = _last(request(cfg.control_socket, args.command, verb_args))
    except ControlError as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"hostagent: {clean(reply.get('error'), None)}", file=sys.stderr)
        return 1
    data = reply["data"]
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        if "message" in data:  # hold, resume, lend, reserve: what it changed
            print(clean(data["message"], None) + ("" if args.command == "reserve" else "\n"))
        if args.command != "reserve":
            print(format_status(data))
    return 0


def _lendee_arg(args: argparse.Namespace) -> dict[str, str]:
    """hold, resume, lend and reclaim: {"lendee": NAME} where --lendee names one."""
    lendee = getattr(args, "lendee", None)
    return {} if lendee is None else {"lendee": lendee}


def log_to_journal(cfg: configuration.Config) -> None:
    """Log records go to the journal, the record being the message itself (level and
    logger are fields of it); `log_level` sets hostagent's own loggers, while libraries
    stay at info and above."""
    logging.basicConfig(level=logging.INFO, format="%(message)s",
                        handlers=[journal.LogHandler()], force=True)
    logging.getLogger("hostagent").setLevel(cfg.log_level.upper())


def _config_problems(e: configuration.ConfigError) -> None:
    """Every problem of the file, one line each (key, what is wrong, the fix)."""
    for problem in e.problems:
        print(f"hostagent: {problem}", file=sys.stderr)
    if len(e.problems) > 1:
        print(f"hostagent: {len(e.problems)} problems in the configuration", file=sys.stderr)


# hooks/qemu knows only its built-in paths, the configuration's defaults: libvirtd runs
# it with a scrubbed environment, so HOSTAGENT_SOCKET and HOSTAGENT_SPOOL never reach it.
_HOOK_CANNOT_FOLLOW = {
    "hook_socket": "it always asks the agent at {default}; finding nobody there, it spools "
                   "every event and lets libvirt go on, so a gaming VM whose GPU is lent does "
                   "not wait for it (its start fails on the busy GPU)",
    "state_dir": "it always spools to {default}/spool while the agent is down, and the agent "
                 "replays {path}/spool: those events are never replayed",
}
# Where systemd/hostagent.service (and the NixOS module) let the agent write
# (RuntimeDirectory=, StateDirectory=): ProtectSystem=strict makes the rest read-only,
# and PrivateTmp=yes gives the agent a /tmp nobody else sees.
_WRITABLE = (Path("/run/hostagent"), Path("/var/lib/hostagent"))
_PRIVATE = (Path("/tmp"), Path("/var/tmp"))


def path_warnings(cfg: configuration.Config) -> list[str]:
    """Paths set in the configuration that the hook or the systemd unit cannot follow."""
    warnings = []
    for key in ("hook_socket", "state_dir", "control_socket"):
        path: Path = getattr(cfg, key)
        default = configuration.Config.__dataclass_fields__[key].default
        if path == default:
            continue
        reasons = []
        if key in _HOOK_CANNOT_FOLLOW:
            reasons.append("libvirtd runs the hook with a scrubbed environment, so the hook "
                           "cannot follow it: "
                           + _HOOK_CANNOT_FOLLOW[key].format(default=default, path=path))
        directory = path if key == "state_dir" else path.parent
        private = any(directory.is_relative_to(p) for p in _PRIVATE)
        if private:
            reasons.append(f"the systemd unit's PrivateTmp=yes gives the agent a {directory} "
                           "of its own, which no other process sees")
        elif not any(directory.is_relative_to(w) for w in _WRITABLE):
            reasons.append(f"the systemd unit's ProtectSystem=strict makes {directory} "
                           "read-only to the agent (it may write only under /run/hostagent "
                           "and /var/lib/hostagent)")
        if not reasons:
            continue
        fix = f"remove {key} (default {default})"
        if key not in _HOOK_CANNOT_FOLLOW and not private:
            fix += (f", or add ReadWritePaths={directory} to the unit "
                    "(systemctl edit hostagent)")
        warnings.append(f'{key} = "{path}": ' + "; ".join(reasons) + f". Fix: {fix}.")
    return warnings + _read_warnings(cfg)


def host_warnings(cfg: configuration.Config) -> list[str]:
    """What the agent would wait for on this host rather than stop on (its health red):
    a domain libvirt does not have, a control_group or a kubeconfig that is not there.
    Not inside the Nix build sandbox (NIX_BUILD_TOP), which has none of the host."""
    if "NIX_BUILD_TOP" in os.environ:
        return []
    warnings = []
    defined: set[str] | None = None  # None: the domains could not be listed
    try:
        import libvirt
    except ImportError as e:  # the config is still checked: libvirt-python is built apart
        warnings.append(f"libvirt_uri: the domains are not checked: libvirt-python is not "
                        f"installed ({e})")
    else:
        libvirt.registerErrorHandler(lambda *_: None, None)  # said below, once
        try:
            conn = libvirt.openReadOnly(cfg.libvirt_uri)
            try:
                defined = {d.name() for d in conn.listAllDomains()}
            finally:
                conn.close()
        except libvirt.libvirtError as e:
            warnings.append(f"libvirt_uri: {cfg.libvirt_uri} cannot be read ({e}); the "
                            "domains are not checked")
    if defined is not None:
        lendees = ({"lendee.domain": cfg.lendee.domain} if len(cfg.lendees) == 1 else
                   {f"lendees.{n}": n for n in cfg.lendees})
        for key, dom in {**lendees, **{f"owners.{d}": d for d in cfg.owners}}.items():
            if dom not in defined:
                warnings.append(f"{key}: libvirt at {cfg.libvirt_uri} has no domain {dom!r}: "
                                "fix the name, define the VM (virsh define), or remove the "
                                "entry; the agent runs without it meanwhile")
    if cfg.control_group is not None:
        import grp
        try:
            grp.getgrnam(cfg.control_group)
        except KeyError:
            warnings.append(f"control_group: there is no group {cfg.control_group!r} on this "
                            f"host; create it (groupadd {cfg.control_group}): until then the "
                            "control socket is root's alone")
    kubeconfig = cfg.kubernetes.kubeconfig if cfg.kubernetes else None
    if kubeconfig is not None and not kubeconfig.exists():
        warnings.append(f"kubernetes.kubeconfig: {kubeconfig} does not exist; the Kubernetes "
                        "steps wait for it")
    for name, lendee in cfg.lendees.items():  # a lendee's own credentials (several lendees)
        if cfg.kubernetes and lendee.kubeconfig is not None and not lendee.kubeconfig.exists():
            warnings.append(f"lendees.{name}.kubeconfig: {lendee.kubeconfig} does not exist; "
                            "its Kubernetes steps wait for it")
    return warnings


# The unit's ProtectHome=tmpfs leaves the agent empty home directories but what
# BindReadOnlyPaths= puts back: the Kubernetes client's default kubeconfig directory.
_HOMES = (Path("/home"), Path("/root"), Path("/run/user"))
_HOME_KEPT = Path("/root/.kube")


def _read_warnings(cfg: configuration.Config) -> list[str]:
    """Files the agent reads that the unit hides (ProtectHome=) or that root reads only
    with CAP_DAC_READ_SEARCH, which the unit does not keep."""
    verify_ssh, mqtt = cfg.verify.ssh, cfg.mqtt
    read: dict[str, Path | None] = {
        "kubernetes.kubeconfig": cfg.kubernetes.kubeconfig if cfg.kubernetes else None,
        "verify.ssh.key": verify_ssh.key if verify_ssh else None,
        "verify.ssh.known_hosts": verify_ssh.known_hosts if verify_ssh else None,
        "ssh.host_key": cfg.ssh.host_key if cfg.ssh else None,
        "ssh.authorized_keys": cfg.ssh.authorized_keys if cfg.ssh else None,
        "mqtt.ca": mqtt.ca if mqtt else None,
        "mqtt.password_file": mqtt.password_file if mqtt else None,
    }
    warnings = []
    for key, path in read.items():
        if path is None:
            continue
        if any(path.is_relative_to(h) for h in _HOMES) and not path.is_relative_to(_HOME_KEPT):
            instead = " (or, on NixOS, give it as kubeconfigFile)" if key.startswith("kube") else ""
            warnings.append(
                f'{key} = "{path}": the systemd unit\'s ProtectHome=tmpfs hides home '
                f"directories from the agent, all but {_HOME_KEPT}. Fix: keep it under "
                f"/etc/hostagent{instead}, or add BindReadOnlyPaths={path} to the unit "
                "(systemctl edit hostagent).")
            continue
        try:
            st = path.stat()
        except OSError:  # missing, or hidden from whoever checks: the agent says so at start
            continue
        if not (st.st_uid == 0 and st.st_mode & stat.S_IRUSR
                or st.st_gid == 0 and st.st_mode & stat.S_IRGRP
                or st.st_mode & stat.S_IROTH):
            warnings.append(
                f'{key} = "{path}": owned by uid {st.st_uid}, mode '
                f"{stat.S_IMODE(st.st_mode):04o}, so root reads it only with "
                "CAP_DAC_READ_SEARCH, which the systemd unit does not keep. "
                f"Fix: chown root {path}.")
    return warnings


def _placed(cfg: configuration.Config, sysfs: Path) -> configuration.Config:
    """`cfg` as it is on this host: GPUs given by UUID placed at the address NVML
    reports for them, every GPU with every function of its slot and its IOMMU groups.
    Raises ConfigError."""
    from hostagent.host import gpus
    if any(g.uuid for g in cfg.gpus.values()):
        try:
            seen, error = gpus.read_nvml(), None
        except gpus.NvmlUnavailable as e:
            seen, error = [], str(e)
        cfg = gpus.resolve_uuids(cfg, seen, nvml_error=error)
    return gpus.on_host(cfg, sysfs)


def _gpus(args: argparse.Namespace) -> int:
    from hostagent.host import gpus
    inv = gpus.inventory(args.sysfs)
    if args.json:
        json.dump(gpus.inventory_json(inv), sys.stdout, indent=2)
        print()
    else:
        print(gpus.format_inventory(inv))
    return 0 if inv.nvml or inv.pci else 1


def _domains(files: list[Path], uri: str, names: list[str] | None) -> list[lint.Domain]:
    """Domains from XML files, or from libvirt: their persistent definitions (the lendee
    may run with some of its GPUs only) and whether libvirt autostarts them.
    Raises OSError, HostError or ValueError."""
    from hostagent.host import lint
    if files:
        return [lint.parse_domain(f.read_text()) for f in files]
    from hostagent.host.libvirt import read_domains
    return [lint.parse_domain(d.xml, autostart=d.autostart)
            for d in read_domains(uri, names).values()]


def _lint(args: argparse.Namespace) -> int:
    from hostagent.host import lint
    from hostagent.host.libvirt import HostError
    cfg: configuration.Config | None = None
    if args.config.exists():
        try:
            cfg = _placed(configuration.load(args.config), args.sysfs)
        except configuration.ConfigError as e:
            _config_problems(e)
            return 2
    else:
        print(f"hostagent: no configuration at {args.config}: checking the domains alone",
              file=sys.stderr)
    uri = args.connect or (cfg.libvirt_uri if cfg else "qemu:///system")
    try:
        domains = _domains(args.xml, uri, args.domains or None)
    except (OSError, HostError, ValueError) as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 2
    if args.xml and args.domains:
        domains = [d for d in domains if d.name in args.domains]
    findings = lint.lint(domains, sysfs=args.sysfs, config=cfg)
    if findings:
        print(lint.format_findings(findings))
    note = lint.regrow_note(domains, cfg) if cfg is not None else None
    if note:
        print(note)
    errors = len(lint.errors(findings))
    warnings = len(findings) - errors
    print(f"{len(domains)} domain(s) checked: {errors} error(s), {warnings} warning(s)")
    return 1 if errors else 0


def _config_init(args: argparse.Namespace) -> int:
    from hostagent.service import config_init
    from hostagent.host import gpus
    from hostagent.host.libvirt import HostError
    output = args.output or str(args.config)
    target = Path(output)
    if output != "-" and target.exists() and not args.force:
        print(f"hostagent: {target} exists: left as it is (--force overwrites it)",
              file=sys.stderr)
        return 1
    try:
        domains = _domains(args.xml, args.connect, None)
    except (OSError, HostError, ValueError) as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 2
    try:
        seen, error = gpus.read_nvml(), None
    except gpus.NvmlUnavailable as e:
        seen, error = [], str(e)
    try:
        text = config_init.starter_config(
            domains, sysfs=args.sysfs, nvml=seen, nvml_error=error, lendee_name=args.lendee,
            source=", ".join(map(str, args.xml)) if args.xml else args.connect)
    except config_init.InitError as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 1
    if output == "-":
        sys.stdout.write(text)
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    if args.force:
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(target)
    else:
        try:
            with open(target, "x") as f:  # never over a file that appeared meanwhile
                f.write(text)
        except FileExistsError:
            print(f"hostagent: {target} exists: left as it is (--force overwrites it)",
                  file=sys.stderr)
            return 1
    print(f"wrote {target}: check the comments in it, then run `hostagent --config {target} "
          "lint`")
    return 0


def _history(args: argparse.Namespace) -> int:
    from hostagent.surfaces import history, timeline
    unit = args.unit or history.UNIT
    try:
        records = history.read_journal(since=args.since, until=args.until,
                                       directory=args.journal_dir, unit=unit)
    except history.HistoryError as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 1
    now = time.time()
    h = history.build(records, until=history.until_time(args.until, now=now)
                      if args.until else now, unit=unit)
    if args.svg:
        args.svg.write_text(timeline.svg(h))
    if args.json:
        json.dump(history.to_json(h), sys.stdout, indent=2)
        print()
    else:
        print(history.format_table(h))
    return 0


def _unmark_node(cfg: configuration.Config, *, dry_run: bool,
                 kubeconfig: Path | None = None) -> int:
    """`hostagent unmark-node`: for an uninstall, or a node that leaves hostagent's care."""
    if cfg.kubernetes is None:
        print("hostagent: the configuration has no [kubernetes] section: hostagent put "
              "nothing on any node", file=sys.stderr)
        return 2
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(cfg.control_socket))
            running = True
        except (FileNotFoundError, ConnectionRefusedError):
            running = False  # no socket, or nobody behind it: the agent is stopped
        except OSError:
            running = True  # there, but not ours to use: take it as running
    if running:
        print("hostagent: the agent is running and would mark the node again: stop it "
              "first (systemctl stop hostagent)", file=sys.stderr)
        return 1
    import asyncio
    import dataclasses

    from hostagent.cluster.cycle import parse_taint
    from hostagent.cluster.kube import Kube, KubeError

    async def unmark(node: str, k: configuration.Kubernetes) -> list[str]:
        async with await Kube.from_config(k) as kube:
            return await kube.unmark(
                node, marker_prefix=k.annotation_prefix, label=k.borrowed_label,
                taints=[parse_taint(t) for t in k.lent_taints], dry_run=dry_run)

    for view in (cfg.view(name) for name in cfg.lendees):
        k = view.kubernetes  # each lendee's node, with its own credentials (lendees.NAME)
        assert k is not None
        given = k if kubeconfig is None else dataclasses.replace(
            k, kubeconfig=kubeconfig.absolute())
        try:
            removed = asyncio.run(unmark(view.lendee.node, given))
        except KubeError as e:
            print(f"hostagent: {view.lendee.node}: {clean(str(e), None)}", file=sys.stderr)
            if kubeconfig is None and k.kubeconfig is not None and not k.kubeconfig.exists():
                # NixOS's kubeconfigFile is a credential of the unit, removed when it stops.
                print("hostagent: give the cluster's kubeconfig with --kubeconfig PATH (on "
                      "NixOS the file services.hostagent.kubeconfigFile names: the unit's "
                      "credential is gone once it stops)", file=sys.stderr)
            return 1
        verb = "would take off" if dry_run else "took off"
        if not removed:
            print(f"{view.lendee.node}: nothing of hostagent's is on it")
        for what in removed:
            print(f"{view.lendee.node}: {verb} {clean(what, None)}")
    return 0


def _reserve_args(args: argparse.Namespace) -> dict[str, Any]:
    """The reserve verb's arguments: a time (of a series, with --every), or a cancel (of
    the whole series, with --all)."""
    if args.cancel:
        return {"vm": args.vm, "cancel": True, **({"every": True} if args.all else {})}
    return {"vm": args.vm, "at": args.at, **({"every": args.every} if args.every else {})}


def _last(replies: Any) -> dict[str, Any]:
    """The result line; progress lines before it are for commands that stream."""
    result: dict[str, Any] = {}
    for reply in replies:
        result = reply
    return result


if __name__ == "__main__":
    sys.exit(main())
