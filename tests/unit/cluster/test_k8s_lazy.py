"""hostagent.cluster.lazy: kubernetes-asyncio's generated packages, imported name by name."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a fresh interpreter: what is imported depends on what was imported before.
CHECK = textwrap.dedent("""
    import asyncio
    import sys
    import hostagent.cluster.kube
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client import ApiClient, models

    loaded = [m for m in sys.modules if m.startswith("kubernetes_asyncio.client.models.")]
    assert len(loaded) < 20, loaded
    assert "V1Pod" in dir(client) and "V1Pod" in models.__all__
    assert client.V1Pod is models.V1Pod is sys.modules[
        "kubernetes_asyncio.client.models.v1_pod"].V1Pod
    assert client.CoreV1Api.__module__ == "kubernetes_asyncio.client.api.core_v1_api"
    assert client.__version__ and client.ApiException
    try:
        client.NoSuchThing
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("an unknown name was found")

    # The library looks model classes up by name when it reads an answer.
    class Answer:
        data = '{"metadata": {"name": "gpu-node"}, "spec": {"unschedulable": true}}'
    async def read():
        async with ApiClient() as api:
            return api.deserialize(Answer(), "V1Node")
    node = asyncio.run(read())
    assert node.metadata.name == "gpu-node" and node.spec.unschedulable is True
    print("ok")
""")


def test_models_are_imported_on_first_use() -> None:
    done = subprocess.run([sys.executable, "-W", "error", "-c", CHECK], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
