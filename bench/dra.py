"""DRA while lent: what 5,000 ResourceClaims elsewhere in the cluster cost the node's watch.

    python -m bench.dra [--claims 5000] [--runs 5]

Against the real control plane (tests/controlplane, the lab's release): node gpu-node
with two GPUs in NVIDIA's driver's slices and one pod holding one through a claim, and
`--claims` claims in another namespace (unallocated, as pending work's are). Timed:

- "list every claim": the request and the parsing into the client's models of
  ``list_resource_claim_for_all_namespaces``, which the watch of the lent node made
  each time it listed (at its start and after every watch that ended, at least once per
  watch_timeout) until it came to read only its pods' claims;
- "first view": `Kube.watch_node` with the driver, from its start to its first view
  (node, pods, slices and the pod's claim read by name), as the agent does now; with
  the foreign claims and without.

Each is the median of `--runs`, on the machine's CPUs as they are (the API server runs
on them too). The parse of a list runs on the agent's event loop: "list every claim"
is also how long the old watch held up everything else the agent does. Measured
2026-12-04 on 2 loaded CPUs (AMD EPYC): list every claim (5,001) 3,923 ms; first view
with 5,000 claims elsewhere 153 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from hostagent.cluster.kube import Kube, NodeView
from tests.controlplane import ControlPlane
from tests.controlplane.nvidia import DEVICE_CLASS, Driver, gpu
from tests.unit.kube_scaffold import FAST

NODE = "gpu-node"


def _claims(plane: ControlPlane, namespace: str, count: int) -> None:
    for start in range(0, count, 500):
        items = [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                  "metadata": {"name": f"job-{i}"},
                  "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                      "deviceClassName": "gpu.nvidia.com"}}]}}}
                 for i in range(start, min(count, start + 500))]
        plane.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": items}))


async def _first_view(kube: Kube) -> float:
    seen: asyncio.Future[NodeView] = asyncio.get_running_loop().create_future()

    def on_change(view: NodeView) -> None:
        if not seen.done():
            seen.set_result(view)

    began = time.perf_counter()
    watch = asyncio.create_task(kube.watch_node(NODE, resources=["nvidia.com/gpu"],
                                                on_change=on_change,
                                                dra_driver="gpu.nvidia.com"))
    view = await asyncio.wait_for(seen, 60)
    spent = time.perf_counter() - began
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    assert view.holders, "the pod's claim was not seen holding its GPU"
    return spent


async def _list_all(kube: Kube) -> float:
    began = time.perf_counter()
    listed = await kube._resource.list_resource_claim_for_all_namespaces()
    spent = time.perf_counter() - began
    assert len(listed.items) > 0
    return spent


async def _measure(plane: ControlPlane, claims: int, runs: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    async with Driver(plane.admin, NODE) as driver, \
            await Kube.connect(plane.admin, timing=FAST) as kube:
        await driver.publish([gpu(0, "GPU-a"), gpu(1, "GPU-b")])
        await _first_view(kube)  # the connection and the client's first parse, untimed
        figures["first view, no claims elsewhere"] = statistics.median(
            [await _first_view(kube) for _ in range(runs)])
        await asyncio.to_thread(plane.namespace, "elsewhere")
        await asyncio.to_thread(_claims, plane, "elsewhere", claims)
        figures[f"list every claim ({claims + 1})"] = statistics.median(
            [await _list_all(kube) for _ in range(runs)])
        figures[f"first view, {claims} claims elsewhere"] = statistics.median(
            [await _first_view(kube) for _ in range(runs)])
    return figures


def _node_and_pod(plane: ControlPlane) -> None:
    """gpu-node (no kubelet: nothing here needs one) and a pod on it whose claim is
    allocated gpu-0 and reserved for it, written as the scheduler leaves them."""
    plane.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_CLASS))
    plane.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
    plane.namespace("work")
    plane.kubectl("create", "-n", "work", "-f", "-", input=json.dumps({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com"}}]}}}))
    pod = json.loads(plane.kubectl("create", "-n", "work", "-o", "json", "-f", "-",
                                   input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train"},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "pause"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": "train-gpu"}]}})).stdout)
    plane.kubectl("patch", "resourceclaim", "-n", "work", "train-gpu", "--subresource=status",
                  "--type=merge", "-p", json.dumps({"status": {
                      "allocation": {"devices": {"results": [{
                          "request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE,
                          "device": "gpu-0"}]}},
                      "reservedFor": [{"resource": "pods", "name": "train",
                                       "uid": pod["metadata"]["uid"]}]}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--markdown", type=Path, help="also append the table to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        plane = ControlPlane(Path(root)).start()
        try:
            _node_and_pod(plane)
            figures = asyncio.run(_measure(plane, args.claims, args.runs))
        finally:
            plane.stop()
    table = ["| DRA while lent | median ms |", "|---|---|",
             *(f"| {what} | {seconds * 1000:.0f} |" for what, seconds in figures.items())]
    print("\n".join(table))
    if args.markdown:
        with args.markdown.open("a") as out:
            out.write(f"\nDRA: the lent node's watch with {args.claims:,} ResourceClaims "
                      f"elsewhere in the cluster, median of {args.runs} (bench/dra.py)\n\n"
                      + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
