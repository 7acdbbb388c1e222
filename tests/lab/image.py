"""The lab guest: a kernel built for it and an initramfs with busybox and a real qemu-ga.

The kernel is Debian's linux-source built over `make tinyconfig` with guest/kernel.config
(serial console, initramfs, ACPI, PCI with PCIe and ACPI hot-plug, virtio's PCI, block and
console drivers, all built in): under QEMU's TCG, Debian's cloud kernel spent about 2.5 s
of CPU on each boot, most of it on what a lab guest has no use for (crypto self-tests,
kprobes, a hundred drivers' probes, modules), and the suite boots guests hundreds of
times on 2 cores. It is built once per source version and configuration, into the cache
outside the clone that the lab's Kubernetes uses (`$HOSTAGENT_LAB_CACHE`, or
~/.cache/hostagent-lab): a few minutes on 2 cores.

busybox and qemu-ga come from Debian packages (downloaded with `apt-get download`, never
installed on the host). The image is cached under `.lab/image/<hash>`, where the hash
covers the package versions and the guest files, so it is rebuilt only when one of them
changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GUEST = HERE / "guest"
PACKAGES = ("busybox-static", "qemu-guest-agent")
SOURCE = "linux-source"  # the metapackage: it depends on linux-source-<version>
KERNEL_CONFIG = GUEST / "kernel.config"


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path


def _run(*argv: str, cwd: Path | None = None) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True).stdout


def _candidate(package: str) -> tuple[str, str]:
    """The package apt would download, resolving the kernel source metapackage to its
    versioned package."""
    if package == SOURCE:
        deps = _run("apt-cache", "depends", package)
        package = next(line.split(":", 1)[1].strip() for line in deps.splitlines()
                       if line.strip().startswith("Depends:") and f"{SOURCE}-" in line)
    policy = _run("apt-cache", "policy", package)
    version = next(line.split(":", 1)[1].strip() for line in policy.splitlines()
                   if line.strip().startswith("Candidate:"))
    if version == "(none)":
        raise RuntimeError(f"apt has no candidate for {package}: run `apt-get update`")
    return package, version


def _inputs_hash(pins: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, version in pins:
        h.update(f"{name}={version}\n".encode())
    for f in sorted(GUEST.iterdir()) + [Path(__file__)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def build(cache: Path) -> GuestImage:
    pins = [_candidate(p) for p in (SOURCE, *PACKAGES)]
    out = cache / "image" / _inputs_hash(pins)
    image = GuestImage(out / "vmlinuz", out / "initrd.img")
    if image.kernel.exists() and image.initrd.exists():
        return image
    kernel = _kernel(*pins[0])
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        work = Path(tmp)
        debs = _download(pins[1:], work)
        pkg = work / "pkg"
        for deb in sorted(debs.iterdir()):
            _run("dpkg-deb", "-x", str(deb), str(pkg))
        root = work / "root"
        _assemble(pkg, root)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kernel, out / "vmlinuz.tmp")
        (out / "initrd.img.tmp").write_bytes(_cpio(root))
        os.replace(out / "vmlinuz.tmp", image.kernel)
        os.replace(out / "initrd.img.tmp", image.initrd)
    return image


def _download(pins: list[tuple[str, str]], work: Path) -> Path:
    debs = work / "debs"
    debs.mkdir()
    # _apt cannot write into root's private temp dir; download as root quietly.
    _run("apt-get", "download", "-q", "-o", "APT::Sandbox::User=root",
         *(f"{n}={v}" for n, v in pins), cwd=debs)
    return debs


def shared_cache() -> Path:
    """The lab's cache outside the clone, for what a fresh clone should not build again:
    the guest's kernel and the lab's Kubernetes (tests/controlplane, its build.sh too)."""
    if os.environ.get("HOSTAGENT_LAB_CACHE"):
        return Path(os.environ["HOSTAGENT_LAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hostagent-lab"


def _kernel(package: str, version: str) -> Path:
    """The lab's kernel, built from `package` at `version` unless the cache has it."""
    config = KERNEL_CONFIG.read_text()
    tag = hashlib.sha256(f"{package}={version}\n{config}".encode()).hexdigest()[:12]
    out = shared_cache() / f"kernel-{version}-{tag}"
    if (out / "bzImage").exists():
        return out / "bzImage"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the lab guest's kernel from {package} {version} "
          f"(once, cached in {out}; a few minutes on 2 cores)", file=sys.stderr, flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        work = Path(tmp)
        debs = _download([(package, version)], work)
        _run("dpkg-deb", "-x", str(next(debs.iterdir())), str(work / "pkg"))
        tarball = next((work / "pkg/usr/src").glob("linux-source-*.tar.xz"))
        _run("tar", "-xJf", str(tarball), "-C", str(work))
        src = next(p for p in work.iterdir() if p.name.startswith("linux-source-") and p.is_dir())
        make = ("make", "-s", "ARCH=x86_64", f"-j{os.cpu_count() or 1}")
        _run(*make, "tinyconfig", cwd=src)
        _run("scripts/kconfig/merge_config.sh", "-m", ".config", str(KERNEL_CONFIG), cwd=src)
        _run(*make, "olddefconfig", cwd=src)
        chosen = set((src / ".config").read_text().splitlines())
        missing = [line for line in config.splitlines()
                   if line.startswith("CONFIG_") and line not in chosen]
        if missing:
            raise RuntimeError(f"{KERNEL_CONFIG} asks for what {package} {version} does not "
                               f"offer (a dependency unmet or a renamed option): {missing}")
        built = subprocess.run([*make, "bzImage"], cwd=src, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"the lab guest's kernel did not build:\n{built.stderr[-4000:]}")
        out.mkdir(exist_ok=True)
        shutil.copyfile(src / "arch/x86/boot/bzImage", out / "bzImage.tmp")
        os.replace(out / "bzImage.tmp", out / "bzImage")
    print(f"built the lab guest's kernel in {time.monotonic() - started:.0f}s",
          file=sys.stderr, flush=True)
    return out / "bzImage"


def _assemble(pkg: Path, root: Path) -> None:
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "lib64", "etc", "proc",
              "sys", "dev", "run", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(pkg / "bin/busybox", root / "bin/busybox")
    shutil.copy2(GUEST / "init", root / "init")
    shutil.copy2(GUEST / "shutdown", root / "sbin/shutdown")
    for stand_in in ("nvidia-smi", "nvidia-ctk", "nvidia-persistenced"):
        shutil.copy2(GUEST / stand_in, root / "usr/bin" / stand_in)
    qga = pkg / "usr/sbin/qemu-ga"
    shutil.copy2(qga, root / "usr/sbin/qemu-ga")
    # qemu-ga is dynamically linked: bring the host's copies of its libraries,
    # which are the same Debian release's (qemu-system-x86 depends on them).
    for line in _run("ldd", str(qga)).splitlines():
        parts = line.split()
        lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if lib.startswith("/"):
            dest = root / lib.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), dest)


def _cpio(root: Path) -> bytes:
    listing = "\n".join(sorted(str(p.relative_to(root)) for p in root.rglob("*"))) + "\n"
    return subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root,
                          input=listing.encode(), check=True, capture_output=True).stdout


if __name__ == "__main__":
    img = build(Path(os.environ.get("HOSTAGENT_LAB_CACHE", ".lab")).resolve())
    print(img.kernel, img.initrd)
