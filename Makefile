# The two commands a newcomer runs as root on a fresh Debian 12 machine:
#   make demo   set everything up, then run the real swap in the lab
#   make test   set everything up, then run the whole test suite
# Each does all of its own set-up and skips what is already done.

PYTHON   := /usr/bin/python3
VENV     := .venv
STAMPS   := .stamps
# Host packages: libvirt and QEMU for the private lab daemon; headers and a
# compiler because pip builds libvirt-python and systemd-python from source;
# cpio to pack the lab guest's initramfs, and make, flex, bison, bc, libelf-dev and
# xz-utils to build its kernel from Debian's linux-source (downloaded, not installed);
# systemd for a standalone journald;
# nix-bin for nix-instantiate, which checks that every .nix file parses;
# mosquitto and mosquitto-clients for the lab's broker and the clients that play Home
# Assistant against it (mosquitto_sub, mosquitto_pub). kubectl is the lab's own, built
# with its Kubernetes (tests/controlplane).
APT_PACKAGES := libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients \
	qemu-system-x86 qemu-utils libvirt-dev libsystemd-dev pkg-config gcc \
	python3-venv python3-dev cpio systemd util-linux openssh-client nix-bin mosquitto \
	mosquitto-clients make flex bison bc libelf-dev xz-utils

.PHONY: setup demo test check unit lab faults fuzz explore mutate bench clean
.DEFAULT_GOAL := test

# The lab guest image is cached in .lab/image/ and rebuilt only when its inputs change;
# its kernel, built once per linux-source version and configuration, outside the clone.
# The lab's Kubernetes (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and
# kubectl, tests/controlplane) is built from source with Go once per release, and cached
# outside the clone (~/.cache/hostagent-lab): a later clone on this machine builds nothing.
# So is the real kubelet that plays the lab's lendee node (tests/controlplane/labnode,
# after labkube: about 100 packages more and a link, 83 MB).
# make test installs a real Home Assistant for tests/integration the same way, once
# (about 6 minutes): 2025.4, the last on Python 3.13, with a Python 3.13 the machine has
# (pyenv's); without one, its test skips, saying so.
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)
setup: $(STAMPS)/venv
	$(VENV)/bin/python -m tests.lab.image
	GO=$(GO) tests/controlplane/build.sh >/dev/null
	GO=$(GO) tests/controlplane/labnode/build.sh >/dev/null

# Packages among them whose install enables and starts the machine's own service: the lab
# runs private instances, so when the install is what brought one, its service is
# stopped and disabled again (one the machine had before is left as it was).
APT_SERVICES := mosquitto

$(STAMPS)/apt: Makefile
	@mkdir -p $(STAMPS)
	apt-get update -q
	@new=$$(for p in $(APT_SERVICES); do \
	  dpkg-query -W -f='$${db:Status-Status}' $$p 2>/dev/null | grep -qx installed || echo $$p; \
	done); \
	set -x; DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  $(APT_PACKAGES) || exit 1; set +x; \
	for p in $$new; do \
	  echo "make: stopping and disabling $$p.service, which its install started (the lab runs its own)"; \
	  systemctl disable --now $$p.service >/dev/null 2>&1 || systemctl disable $$p.service || true; \
	done
	@touch $@

$(STAMPS)/venv: pyproject.toml $(STAMPS)/apt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

demo: setup
	$(VENV)/bin/python -m tests.lab.demo

# mypy (hostagent/ and tests/, whose fakes it checks against what they stand in for),
# ruff and lint-imports (the layers' contract in pyproject.toml) first: they take
# seconds and fail fast. Then every test, whole files spread over TEST_PROCESSES
# processes (pytest-xdist): a lab test mostly waits on its TCG guests, so on 2 cores
# three labs at once (each process's lab is private: its own libvirtd, journald, control
# plane and sockets) take far less time than one. (At three, guests used to time out:
# each poll of a lab wait read the process's whole journal, which cost more CPU the
# longer a run went; it reads only what is new now.) The fault suite's table, and the
# figures tests measure, are printed at the end whatever process ran them, and the 15
# slowest tests, so that a slow run says where its time went; and every skip with its
# reason (-rs). Hypothesis draws the same examples every run (tests/conftest.py's
# profile): `make explore` searches at random.
TEST_PROCESSES ?= 3
test: setup
	@echo "the lab's Kubernetes: kube-apiserver $$($$(GO=$(GO) tests/controlplane/build.sh) kube-apiserver --version | cut -d' ' -f2)"
	$(VENV)/bin/mypy
	$(VENV)/bin/ruff check hostagent hooks/qemu tests bench
	$(VENV)/bin/lint-imports
	hass=$$(tests/integration/hass.sh) && HOSTAGENT_HASS=$$hass \
	$(VENV)/bin/pytest -q -rs -p no:cacheprovider -n $(TEST_PROCESSES) --dist loadfile --durations=15 \
	  --no-loadscope-reorder

unit: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/unit

# Every parser fuzzed longer than make test does (HOSTAGENT_FUZZ_EXAMPLES each, 50,000 by
# default), with how many inputs each test tried: the hook and control sockets, the
# spool, SSH command lines, MQTT messages, guest-agent replies, API server bodies and
# watch events, the configuration.
FUZZ_EXAMPLES ?= 50000
fuzz: setup
	HOSTAGENT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest -q -p no:cacheprovider \
	  --hypothesis-show-statistics tests/unit/*/test_fuzz_*.py tests/unit/host/test_libvirt_host.py \
	  | grep -E '^(tests/|  - during generate|    - [0-9]+ passing|[0-9]+ passed)'

# Every Hypothesis test (pytest's `hypothesis` mark) with random draws instead of make
# test's fixed ones, EXPLORE_EXAMPLES each where a test does not set its own number
# (the fuzzers take HOSTAGENT_FUZZ_EXAMPLES, as for fuzz). A failure prints the blob
# that replays it (@reproduce_failure).
EXPLORE_EXAMPLES ?= 20000
explore: setup
	HOSTAGENT_EXPLORE_EXAMPLES=$(EXPLORE_EXAMPLES) HOSTAGENT_FUZZ_EXAMPLES=$(EXPLORE_EXAMPLES) \
	  $(VENV)/bin/pytest -q -rs -p no:cacheprovider --hypothesis-profile=explore \
	  --hypothesis-show-statistics -m hypothesis tests/unit

# Mutation testing (mutmut 3, the `mutate` extra): how many small changes of
# hostagent/core/ and of host/'s pure parts (gpus, iommu, lint*) the unit tests of core/
# and host/ catch; [tool.mutmut] in pyproject.toml says which. Its score per module,
# then each survivor, by tests/mutation/score.py: the state machine must kill 100 %,
# the rest 95 %, not counting the mutants tests/mutation/equivalent.txt lists with why.
# Slow: every mutant runs the tests that reach it, so not part of make test. One module
# at a time, e.g. MUTATE=hostagent.core.machine (about 500 mutants; each run tries every
# mutant of what it names again, results kept in mutants/). MUTATE_WORKERS: parallel
# mutants. The stateful worlds run 50 times per mutant instead of 400 (Hypothesis).
MUTATE ?= hostagent
MUTATE_WORKERS ?= 2
$(STAMPS)/mutate: pyproject.toml $(STAMPS)/venv
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[test,mutate]'
	@touch $@

mutate: $(STAMPS)/mutate
	HOSTAGENT_FUZZ_EXAMPLES=200 HOSTAGENT_STATEFUL_EXAMPLES=50 $(VENV)/bin/mutmut run \
	  --max-children $(MUTATE_WORKERS) '$(MUTATE).*'
	$(VENV)/bin/python -m tests.mutation.score $(MUTATE)

# The fault-injection suite alone, in the lab; it ends with its table of figures.
faults: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/faults

# Benchmarks, not tests: figures and ratios measured in one run, written with the
# machine's description and the commit measured to bench/RESULTS.md (README's figures are
# read from there). Written beside it first and moved into place at the end, so that a
# run that fails leaves the last complete results.
bench: setup
	@set -e; out=bench/.RESULTS.md.tmp; trap 'rm -f $$out' EXIT; \
	{ echo "# Benchmark results"; echo; \
	  echo "Measured $$(date -u '+%Y-%m-%d %H:%M UTC') at commit $$(git describe --always --dirty --abbrev=12 2>/dev/null || echo unknown) on $$(nproc) CPUs ($$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $$(free -g | awk '/^Mem:/ {print $$2}') GiB, $$(uname -sr); libvirt $$(libvirtd --version | awk '{print $$NF}'), $$(qemu-system-x86_64 --version | head -1); the lab's guests run under TCG."; \
	  echo; echo "What each figure measures, and between which boundaries: the docstrings of bench/hook.py, bench/cycle.py, bench/agent.py, bench/capacity.py, bench/dra.py and bench/hotplug.py."; } > $$out; \
	$(VENV)/bin/python bench/hook.py --runs 500 --markdown $$out; \
	$(VENV)/bin/python -m bench.cycle --cycles 5 --markdown $$out; \
	$(VENV)/bin/python -m bench.agent --markdown $$out; \
	$(VENV)/bin/python -m bench.capacity --markdown $$out; \
	$(VENV)/bin/python -m bench.dra --markdown $$out; \
	$(VENV)/bin/python -m bench.hotplug --markdown $$out; \
	mv -f $$out bench/RESULTS.md; \
	echo; echo "written to bench/RESULTS.md"

clean:
	rm -rf $(STAMPS) .lab

# --- installing on Debian (or any systemd distribution) -------------------------------
#   make install     the package in a venv at PREFIX, the unit, the libvirt hook, and
#                    CONFDIR/config.example.toml (CONFDIR/config.toml is never touched)
#   make uninstall   all of that but the configuration and /var/lib/hostagent
# DESTDIR stages the whole tree under another directory (the tests do) and then
# nothing outside it is touched: no systemctl, no libvirtd.
DESTDIR  ?=
PREFIX   ?= /opt/hostagent
BINDIR   ?= /usr/local/bin
CONFDIR  ?= /etc/hostagent
UNITDIR  ?= /etc/systemd/system
# libvirt >= 6.5 runs every executable in qemu.d/ after hooks/qemu (Debian 12 has 9.0).
HOOKDIR  ?= /etc/libvirt/hooks/qemu.d
# libvirtd runs hooks with a fixed PATH, so the hook's interpreter is an absolute
# path. The hook needs the standard library only: the system interpreter starts
# fastest with -I -S, and it outlives the venv (a hook whose interpreter is gone makes
# every VM start fail).
HOOK_PYTHON ?= $(PYTHON)
# e.g. --no-deps, or --index-url for a mirror.
PIP_INSTALL_FLAGS ?=

.PHONY: install uninstall
install:
	@test -x $(PYTHON) || { echo "make install: $(PYTHON) not found"; exit 1; }
	test -x $(DESTDIR)$(PREFIX)/bin/python || $(PYTHON) -m venv $(DESTDIR)$(PREFIX)
	@# Built from a copy, so the working tree gets no build/ or egg-info from it.
	src=$$(mktemp -d) && trap 'rm -rf "$$src"' EXIT && \
	cp -R pyproject.toml README.md hostagent "$$src"/ && \
	$(DESTDIR)$(PREFIX)/bin/python -m pip install -q --disable-pip-version-check \
		$(PIP_INSTALL_FLAGS) "$$src"
	@# A venv records its own path in its scripts: make them name the final one.
	@if [ -n "$(DESTDIR)" ]; then \
		grep -rlI -- "$(DESTDIR)$(PREFIX)" $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/pyvenv.cfg \
		| xargs -r sed -i "s|$(DESTDIR)$(PREFIX)|$(PREFIX)|g"; fi
	install -d -m 0755 $(DESTDIR)$(BINDIR)
	ln -sfn $(PREFIX)/bin/hostagent $(DESTDIR)$(BINDIR)/hostagent
	@# The example beside the configuration, which is never written here: `hostagent
	@# config init` writes a first one from the VMs' <hostdev>s and refuses to replace one.
	install -d -m 0755 $(DESTDIR)$(CONFDIR)
	install -m 0644 examples/config.toml $(DESTDIR)$(CONFDIR)/config.example.toml
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	sed -e 's|/opt/hostagent/|$(PREFIX)/|g' -e 's|/etc/hostagent/|$(CONFDIR)/|g' \
		systemd/hostagent.service > $(DESTDIR)$(UNITDIR)/.hostagent.service.tmp
	chmod 0644 $(DESTDIR)$(UNITDIR)/.hostagent.service.tmp
	mv -f $(DESTDIR)$(UNITDIR)/.hostagent.service.tmp $(DESTDIR)$(UNITDIR)/hostagent.service
	@# Written beside qemu.d/, then renamed into it: libvirtd may run the hook at any
	@# moment and must never find half a file.
	install -d -m 0755 $(DESTDIR)$(HOOKDIR)
	sed '1s|^#!.*|#!$(HOOK_PYTHON) -IS|' hooks/qemu > $(DESTDIR)$(HOOKDIR)/../.hostagent-hook.tmp
	chmod 0755 $(DESTDIR)$(HOOKDIR)/../.hostagent-hook.tmp
	mv -f $(DESTDIR)$(HOOKDIR)/../.hostagent-hook.tmp $(DESTDIR)$(HOOKDIR)/hostagent
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo
	@echo "hostagent is installed in $(PREFIX). Next:"
	@if [ -e $(DESTDIR)$(CONFDIR)/config.toml ]; then \
		echo "  1. $(CONFDIR)/config.toml is kept as it was; check it:"; \
	else \
		echo "  1. write $(CONFDIR)/config.toml from your VMs: hostagent config init"; \
		echo "     (or start from $(CONFDIR)/config.example.toml); edit it ([kubernetes] is"; \
		echo "     commented out: uncomment it if the lendee is a Kubernetes node), then:"; \
	fi
	@echo "       hostagent check-config && hostagent lint"
	@echo "  2. the lendee's prerequisites and the host's boot and shutdown: README.md,"
	@echo "     Installing on Debian"
	@echo "  3. start it now and at every boot: systemctl enable --now hostagent"
	@echo "  4. libvirtd looks for hooks only when it starts: if $(HOOKDIR)/hostagent is"
	@echo "     the first hook on this machine, restart it once (running VMs keep running):"
	@echo "       systemctl restart libvirtd"
	@echo "  Follow it with: journalctl -u hostagent -f"

uninstall:
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
		systemctl disable --now hostagent.service || true; fi
	rm -f $(DESTDIR)$(HOOKDIR)/hostagent $(DESTDIR)$(UNITDIR)/hostagent.service \
		$(DESTDIR)$(CONFDIR)/config.example.toml
	rmdir $(DESTDIR)$(CONFDIR) 2>/dev/null || true
	@# Only what install made: the link if it is ours, the prefix if it is a venv.
	if [ "$$(readlink $(DESTDIR)$(BINDIR)/hostagent)" = "$(PREFIX)/bin/hostagent" ]; then \
		rm -f $(DESTDIR)$(BINDIR)/hostagent; fi
	if [ -f $(DESTDIR)$(PREFIX)/pyvenv.cfg ]; then rm -rf $(DESTDIR)$(PREFIX); fi
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "Kept $(CONFDIR)/config.toml and /var/lib/hostagent (configuration and state), if there: remove them by hand if you want."
