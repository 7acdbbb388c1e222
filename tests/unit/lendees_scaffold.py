"""Two lendees and four owners, one of them across both: the configuration the tests of
several lendees share (`[lendees.NAME]`)."""

from __future__ import annotations

GPUS = "".join(f'\n[gpus.gpu-{x}]\npci = "0000:0{i}:00.0"\n' for i, x in enumerate("abcd", 1))


TWO = """
[lendees.node-a]
gpus = ["gpu-a"]

[lendees.node-b]
gpus = ["gpu-b", "gpu-c"]
node = "k8s-b"
min_gpus = 2

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]

[owners.both]
gpus = ["gpu-a", "gpu-c"]

[owners.elsewhere]
gpus = ["gpu-d"]
""" + GPUS
