"""``python -m tests.kubeapi``: the API stand-in as a process; prints its URL, then serves.

Stop it with SIGTERM or SIGINT. With ``--state FILE`` its objects survive a restart
(start it again on the same ``--port``): that is how a lab test takes the API down.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from tests.kubeapi.server import StandIn, write_kubeconfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kubeapi", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument(
        "--state", type=Path, help="read objects from and save them to this JSON file"
    )
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for the stand-in here")
    parser.add_argument("--token", help="require this bearer token")
    parser.add_argument("--termination-scale", type=float, default=1.0,
                        help="wall seconds per second of a pod's grace period")  # fmt: skip
    parser.add_argument("--replacement-node", help="where replacement pods are scheduled")
    parser.add_argument("--replacement-ready-after", type=float,
                        help="seconds until a scheduled replacement pod is Ready")  # fmt: skip
    parser.add_argument("--watch-timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


async def _serve(args: argparse.Namespace) -> None:
    standin = StandIn(
        host=args.host,
        port=args.port,
        token=args.token,
        watch_timeout=args.watch_timeout,
        state_file=args.state,
        termination_scale=args.termination_scale,
        replacement_node=args.replacement_node,
        replacement_ready_after=args.replacement_ready_after,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with standin:
        if args.kubeconfig:
            write_kubeconfig(args.kubeconfig, standin.url, token=args.token)
        print(standin.url, flush=True)
        await stop.wait()


if __name__ == "__main__":
    sys.exit(main())
