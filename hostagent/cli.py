"""`hostagent …`: the service (`run`) and the commands that talk to it."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from hostagent import config as configuration
from hostagent import journal
from hostagent.control import ControlError, request


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hostagent", description=(
        "Lend idle passthrough GPUs to a Kubernetes worker VM; give each back when its "
        "gaming VM starts."))
    p.add_argument("--config", type=Path, default=configuration.DEFAULT_PATH,
                   help=f"configuration file (default {configuration.DEFAULT_PATH})")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the agent (what the systemd unit starts)")
    st = sub.add_parser("status", help="each GPU, its owner and holder; the lendee; intents")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("hold", help="stop lending: the lendee stays off until `resume`")
    sub.add_parser("resume", help="lend again (and retry a step that failed)")
    sub.add_parser("check-config", help="read the configuration and report every problem")
    gp = sub.add_parser("gpus", help="this host's GPUs: NVML (index, UUID, PCI) and sysfs")
    gp.add_argument("--json", action="store_true", help="machine-readable output")
    gp.add_argument("--sysfs", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # These work before there is a configuration.
    if args.command == "gpus":
        return _gpus(args)
    try:
        cfg = configuration.load(args.config)
        if args.command == "run":
            cfg = _placed(cfg)
    except configuration.ConfigError as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(f"{args.config}: OK ({len(cfg.gpus)} GPUs, {len(cfg.owners)} owners, "
              f"lendee {cfg.lendee.domain})")
        return 0
    if args.command == "run":
        logging.basicConfig(level=logging.INFO, handlers=[journal.LogHandler()])
        from hostagent import agent  # libvirt and friends only where needed
        return agent.run(cfg)
    try:
        reply = _last(request(cfg.control_socket, args.command))
    except ControlError as e:
        print(f"hostagent: {e}", file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"hostagent: {reply.get('error')}", file=sys.stderr)
        return 1
    data = reply["data"]
    if getattr(args, "json", False):
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        print(format_status(data))
    return 0


def _placed(cfg: configuration.Config) -> configuration.Config:
    """`cfg` with GPUs given by UUID placed at the address NVML reports for them."""
    if not any(g.uuid for g in cfg.gpus.values()):
        return cfg
    from hostagent import gpus
    try:
        seen, error = gpus.read_nvml(), None
    except gpus.NvmlUnavailable as e:
        seen, error = [], str(e)
    return gpus.resolve_uuids(cfg, seen, nvml_error=error)


def _gpus(args: argparse.Namespace) -> int:
    from hostagent import gpus
    inv = gpus.inventory(args.sysfs)
    if args.json:
        json.dump(gpus.inventory_json(inv), sys.stdout, indent=2)
        print()
    else:
        print(gpus.format_inventory(inv))
    return 0 if inv.nvml or inv.pci else 1


def _last(replies: Any) -> dict[str, Any]:
    """The result line; progress lines before it are for commands that stream."""
    result: dict[str, Any] = {}
    for reply in replies:
        result = reply
    return result


def format_status(data: dict[str, Any]) -> str:
    lendee = data["lendee"]
    since = time.time() - lendee["since"]
    lines = [f"lendee {lendee['domain']}: {lendee['phase']} for {_age(since)}"
             + (" (lending on hold)" if lendee["hold"] else "")]
    if lendee["reason"]:
        lines.append(f"  reason: {lendee['reason']}")
    if data.get("relend_in_s") is not None:
        lines.append(f"  lending again in {_age(data['relend_in_s'])}")
    rows = [("GPU", "NAME", "PCI", "OWNER", "HELD BY")]
    for g in data["gpus"]:
        rows.append((g["gpu"], g["name"] or "-", g["pci"], g["owner"] or "-",
                     g["holder"] or "nobody"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    lines.append("")
    if data["intents"]:
        lines.append("waiting to start:")
        for i in data["intents"]:
            lines.append(f"  {i['owner']} (asked via {i['source']}, {_age(i['age_s'])} ago)")
    else:
        lines.append("nothing waiting to start")
    if not data.get("libvirt_connected", True):
        lines.append("libvirt: NOT connected (reconnecting)")
    return "\n".join(lines)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


if __name__ == "__main__":
    sys.exit(main())
