# The two commands a newcomer runs as root on a fresh Debian 12 machine:
#   make demo   set everything up, then run the real swap in the lab
#   make test   set everything up, then run the whole test suite
# Each does all of its own set-up and skips what is already done.

PYTHON   := /usr/bin/python3
VENV     := .venv
STAMPS   := .stamps
# Host packages: libvirt and QEMU for the private lab daemon; headers and a
# compiler because pip builds libvirt-python and systemd-python from source;
# cpio to pack the lab guest's initramfs; systemd for a standalone journald.
APT_PACKAGES := libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients \
	qemu-system-x86 qemu-utils libvirt-dev libsystemd-dev pkg-config gcc \
	python3-venv python3-dev cpio systemd util-linux openssh-client

.PHONY: setup demo test check unit lab faults bench clean
.DEFAULT_GOAL := test

# The lab guest image is cached in .lab/image/ and rebuilt only when its inputs change.
setup: $(STAMPS)/venv
	$(VENV)/bin/python -m tests.lab.image

$(STAMPS)/apt: Makefile
	@mkdir -p $(STAMPS)
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PACKAGES)
	@touch $@

$(STAMPS)/venv: pyproject.toml $(STAMPS)/apt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

demo: setup
	$(VENV)/bin/python -m tests.lab.demo

# mypy and ruff first: they take seconds and fail fast.
test: setup
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff check hostagent hooks/qemu tests bench
	$(VENV)/bin/pytest -q -p no:cacheprovider

unit: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit

# Benchmarks, not tests: figures and ratios measured in one run, kept in bench/RESULTS.md.
bench: setup
	{ echo "# Benchmark results"; echo; \
	  echo "Measured $$(date -u '+%Y-%m-%d %H:%M UTC') on $$(nproc) CPUs ($$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $$(uname -sr)."; \
	  echo; echo '```'; \
	  $(VENV)/bin/python bench/hook.py --runs 500; echo; \
	  $(VENV)/bin/python -m bench.agent; \
	  echo '```'; } | tee bench/RESULTS.md

clean:
	rm -rf $(STAMPS) .lab
