# services.hostagent: the agent as a NixOS service, and its libvirt hook.
#
#   imports = [ ./hostagent/nix/module.nix ];   # or the flake's nixosModules.default
#   services.hostagent = { enable = true; settings = { ... }; };
#
# The service has the same properties as systemd/hostagent.service, whose comments
# give the reasons: keep the two in step. The settings become /etc/hostagent/config.toml,
# where the `hostagent` command looks by default.
{
  config,
  lib,
  pkgs,
  ...
}:

let
  inherit (lib) mkOption types;

  cfg = config.services.hostagent;
  format = pkgs.formats.toml { };

  configPath = "/etc/hostagent/config.toml";

  # The port of a `listen` setting (a port number, "host:port", "[v6]:port" or ":port"),
  # or null where it listens on loopback alone or is not set (TOML has no null).
  listenPort =
    listen:
    let
      parts = if builtins.isString listen then builtins.match "(.*):([0-9]+)" listen else null;
      loopback = parts != null && builtins.elem (lib.toLower (builtins.head parts)) [
        "127.0.0.1"
        "[::1]"
        "localhost"
      ];
    in
    if builtins.isInt listen then
      listen
    else if parts == null || loopback then
      null
    else
      lib.toInt (builtins.elemAt parts 1);
  openPorts = builtins.filter (p: p != null) (
    map listenPort [
      (cfg.settings.ssh.listen or null)
      (cfg.settings.metrics.listen or null)
    ]
  );
  # Where systemd puts the kubeconfig it reads for the service (LoadCredential=).
  kubeconfigCredential = "/run/credentials/hostagent.service/kubeconfig";
  # And the MQTT broker's password ([mqtt] password_file).
  mqttPasswordCredential = "/run/credentials/hostagent.service/mqtt-password";

  # libvirtd runs the hook with a scrubbed environment, so the hook knows only its
  # built-in paths: the agent must use the same ones.
  hookPaths = {
    hook_socket = "/run/hostagent/hook.sock";
    state_dir = "/var/lib/hostagent";
  };

  generatedConfig = format.generate "hostagent-config.toml" (
    lib.recursiveUpdate cfg.settings (
      lib.optionalAttrs (cfg.kubeconfigFile != null) {
        kubernetes.kubeconfig = kubeconfigCredential;
      }
      // lib.optionalAttrs (cfg.controlSocketGroup != null) {
        control_group = cfg.controlSocketGroup;
      }
      // lib.optionalAttrs (cfg.mqttPasswordFile != null) {
        mqtt.password_file = mqttPasswordCredential;
      }
    )
  );

  # The agent reads the file when the system is built: a key it refuses (a typo in a
  # free-form key, a GPU nobody defined) fails nixos-rebuild with the agent's own message,
  # not the service at boot. tests/packaging/test_nix.py runs this same script.
  checkScript = ''
    if ! hostagent --config "$configFile" check-config; then
      echo "hostagent refuses services.hostagent.settings: each key named above is under settings (services.hostagent.checkConfig = false skips this check)" >&2
      exit 1
    fi
    ln -s "$configFile" "$out"
  '';
  configFile =
    if cfg.checkConfig then
      pkgs.runCommandLocal "hostagent-config-checked.toml" {
        nativeBuildInputs = [ cfg.package ];
        configFile = generatedConfig;
      } checkScript
    else
      generatedConfig;

  # A TOML table with a few typed, documented keys; any other key passes through.
  table =
    options:
    types.submodule {
      freeformType = format.type;
      inherit options;
    };

  optionalStr =
    description:
    mkOption {
      type = types.nullOr types.str;
      default = null;
      inherit description;
    };
in
{
  options.services.hostagent = {
    enable = lib.mkEnableOption "hostagent, which lends idle passthrough GPUs to a Kubernetes worker VM";

    # pkgs.hostagent where the flake's overlay adds it, else this checkout's package.
    package = lib.mkPackageOption (pkgs // { hostagent = pkgs.hostagent or (pkgs.callPackage ./package.nix { }); }) "hostagent" {
      extraDescription = "The libvirt hook comes from it too. Without `pkgs.hostagent` (the flake's `overlays.default` adds it), the package of `nix/package.nix` beside this module.";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Open the TCP ports of the SSH endpoint (`settings.ssh.listen`) and of the
        metrics (`settings.metrics.listen`) in the NixOS firewall, which is on by
        default; a listener on loopback alone (`127.0.0.1`, `[::1]`) needs none.
      '';
    };

    settings = mkOption {
      default = { };
      # TOML has no null: a typed key left at null is left out, and the agent's own
      # default applies.
      # With only lendees.NAME set, the untyped [lendee] (its domain "") is left out.
      apply =
        settings:
        let
          kept = lib.filterAttrsRecursive (_: v: v != null) settings;
        in
        if (kept.lendees or { }) != { } && (kept.lendee.domain or "") == "" then
          removeAttrs kept [ "lendee" ]
        else
          kept;
      description = ''
        hostagent's configuration, written to `${configPath}`. Every key of that
        TOML file can be set here (they are listed in the docstring of
        `hostagent/core/config.py`); the main ones are typed below. Durations are strings
        such as `"90s"`, `"2m"` or `"1h30m"`.
      '';
      example = lib.literalExpression ''
        {
          lendee = { domain = "gpu-node"; gpus = [ "gpu-a" "gpu-b" ]; };
          gpus.gpu-a = { pci = "0000:01:00.0"; functions = [ "0000:01:00.1" ]; name = "RTX 3050"; };
          gpus.gpu-b = { pci = "0000:02:00.0"; functions = [ "0000:02:00.1" ]; };
          owners.gaming1.gpus = [ "gpu-a" ];
          owners.gaming2.gpus = [ "gpu-b" ];
          policy.relend_delay = "30s";
          kubernetes.gpu_resource = "nvidia.com/gpu";
        }
      '';
      type = table {
        lendee = mkOption {
          default = { };
          description = "The Kubernetes worker VM that borrows every idle GPU.";
          type = table {
            domain = mkOption {
              type = types.str;
              default = "";
              example = "gpu-node";
              description = "The lendee's libvirt domain name. Required.";
            };
            node = optionalStr "Its Kubernetes node name; by default its domain name.";
            gpus = mkOption {
              type = types.listOf types.str;
              default = [ ];
              example = [
                "gpu-a"
                "gpu-b"
              ];
              description = "Every GPU it may borrow: labels from `gpus`, or PCI addresses. Required.";
            };
            min_gpus = mkOption {
              type = types.nullOr types.ints.positive;
              default = null;
              example = 2;
              description = "Fewer GPUs free than this, the lendee stays off; at most as many as `gpus` lists (the agent's default: `1`).";
            };
          };
        };

        lendees = mkOption {
          default = { };
          description = "Several Kubernetes worker VMs, by libvirt domain name, each with its own GPUs and node; instead of, or beside, `lendee`.";
          type = types.attrsOf (table {
            node = optionalStr "Its Kubernetes node name; by default its domain name.";
            gpus = mkOption {
              type = types.listOf types.str;
              example = [ "gpu-a" ];
              description = "Every GPU it may borrow: labels from `gpus`, or PCI addresses; a GPU belongs to one lendee. Required.";
            };
            min_gpus = mkOption {
              type = types.nullOr types.ints.positive;
              default = null;
              example = 1;
              description = "Fewer GPUs free than this, the lendee stays off; at most as many as `gpus` lists (the agent's default: `1`).";
            };
          });
        };

        gpus = mkOption {
          default = { };
          description = "Passthrough GPUs, by a label of your choosing.";
          type = types.attrsOf (table {
            pci = mkOption {
              type = types.nullOr types.str;
              default = null;
              example = "0000:01:00.0";
              description = ''
                The GPU's PCI function, as `lspci -D` shows it. A GPU may be given by
                `uuid` alone, placed where NVML sees it when the agent starts; NVML
                cannot see a GPU bound to vfio-pci, so a passthrough GPU needs `pci`.
              '';
            };
            functions = mkOption {
              type = types.listOf types.str;
              default = [ ];
              example = [ "0000:01:00.1" ];
              description = "Its other PCI functions (audio), which move with it.";
            };
            uuid = optionalStr "Its UUID as `nvidia-smi -L` shows it inside the lendee, checked after lending.";
            name = optionalStr "A name for messages.";
          });
        };

        owners = mkOption {
          default = { };
          description = "Gaming VMs, by libvirt domain name.";
          type = types.attrsOf (table {
            gpus = mkOption {
              type = types.listOf types.str;
              example = [ "gpu-a" ];
              description = "The GPUs this VM must have back before it starts.";
            };
          });
        };

        policy = mkOption {
          default = { };
          description = "Choices whose defaults are the careful ones.";
          type = table {
            relend_delay = optionalStr "Quiet time after a game before the GPUs are lent again (the agent's default: `\"30s\"`).";
            force_off_after = optionalStr "How long after a guest-agent shutdown timed out the lendee is destroyed; unset or `\"\"`, it never is.";
            on_drain_timeout = mkOption {
              type = types.nullOr (
                types.enum [
                  "proceed"
                  "abort"
                ]
              );
              default = null;
              description = "When the node has not drained in time: shut the lendee down anyway (`proceed`) or keep it and give up (`abort`) (the agent's default: `\"proceed\"`).";
            };
            partial = mkOption {
              type = types.nullOr types.bool;
              default = null;
              description = "Lend the free GPUs while others play; `false`: the lendee runs only with all of its GPUs (the agent's default: `true`).";
            };
            regrow = mkOption {
              type = types.nullOr (
                types.enum [
                  "when-idle"
                  "always"
                  "never"
                ]
              );
              default = null;
              description = "When a lendee running with fewer GPUs restarts to add those a game freed: once no pod on its node requests a GPU (`when-idle`), after `relend_delay` (`always`), or only when it stops for another reason (`never`) (the agent's default: `\"when-idle\"`).";
            };
            regrow_max_wait = optionalStr "How long a `when-idle` regrow waits for the node's GPU pods before it restarts the lendee anyway; `\"\"`: as long as they run, killing no job (the agent's default).";
            hotplug = mkOption {
              type = types.nullOr (
                types.enum [
                  "none"
                  "add"
                  "both"
                  "auto"
                ]
              );
              default = null;
              description = "Whether GPUs a game freed are attached to the running lendee (`add`: its live definition only, no drain, no restart; one that fails waits for a regrow), also detached live when a game takes one back (`both`, experimental: only the pods using it are evicted, the restart its fallback; NVIDIA does not support hot-unplug of its GPUs) or every change is a restart (`none`); `auto`: `add` where `hostagent lint` finds the lendee's definition can hot-add (root ports and a 64-bit prefetchable window), `both` once the running lendee shows its GPU plugins pause through their node label and its nvidia-smi supports drain, else `none` (the agent's default: `\"auto\"`).";
            };
          };
        };

        kubernetes = mkOption {
          default = null;
          description = ''
            How to reach the cluster. Unset (and no `kubeconfigFile`): no
            `[kubernetes]` section, and hostagent moves GPUs between VMs only.
          '';
          type = types.nullOr (table {
            kubeconfig = optionalStr ''
              A kubeconfig read by the agent at run time; prefer `kubeconfigFile`, which
              also works where the file is readable by root only.
            '';
            gpu_resource = optionalStr "The allocatable resource the node must report (the agent's default: `\"nvidia.com/gpu\"`).";
            gpu_api = mkOption {
              type = types.nullOr (
                types.enum [
                  "auto"
                  "device-plugin"
                  "dra"
                ]
              );
              default = null;
              description = "How the cluster hands out GPUs: allocatable counts (`device-plugin`), devices in ResourceSlices verified by UUID (`dra`, Dynamic Resource Allocation), or decided at each lend from what the node publishes, its ResourceSlices or its GPU capacity (`auto`) (the agent's default: `\"auto\"`).";
            };
            dra_driver = optionalStr "The DRA driver whose ResourceSlices list the GPUs (the agent's default: `\"gpu.nvidia.com\"`).";
          });
        };
      };
    };

    kubeconfigFile = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/secrets/hostagent-kubeconfig";
      description = ''
        A kubeconfig for the lendee's cluster, as a path on the host that systemd
        reads when the service starts (`LoadCredential=`): it never enters the
        world-readable Nix store. Give a string, not a Nix path literal (which would
        be copied into the store). Setting it adds the `[kubernetes]` section.
      '';
    };

    mqttPasswordFile = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/secrets/hostagent-mqtt-password";
      description = ''
        The MQTT broker's password for `settings.mqtt.username`, as a path on the host
        that systemd reads when the service starts (`LoadCredential=`): it never
        enters the world-readable Nix store. Give a string, not a Nix path literal.
        The broker itself is `settings.mqtt.broker` (the `[mqtt]` section).
      '';
    };

    checkConfig = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Check the generated configuration with the package's own `hostagent
        check-config` when the system is built, so that a key the agent refuses
        fails `nixos-rebuild` with the agent's message naming it. The check runs
        the package on the build machine: turn it off when cross-compiling.
      '';
    };

    controlSocketGroup = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "hostagent";
      description = ''
        A group whose members may use the control socket (`hostagent status`,
        `hostagent hold`, `hostagent resume`) without root: the agent makes the
        socket 0660 for it (the `control_group` setting). Add people with
        `users.users.<name>.extraGroups`. The group is created. Unset: root only.
      '';
    };
  };

  config = lib.mkIf cfg.enable {
    assertions = [
      {
        assertion = config.virtualisation.libvirtd.enable;
        message = "services.hostagent needs libvirt: set virtualisation.libvirtd.enable = true (the agent drives the VMs through libvirtd, and its hook is installed through virtualisation.libvirtd.hooks.qemu).";
      }
      {
        assertion = (cfg.settings.lendee.domain or "") != "" || (cfg.settings.lendees or { }) != { };
        message = ''services.hostagent.settings.lendee.domain is not set: name the libvirt domain of the Kubernetes worker VM that borrows the GPUs, e.g. lendee.domain = "gpu-node";'';
      }
      {
        assertion = !(cfg.settings ? lendee) || cfg.settings.lendee.gpus != [ ];
        message = ''services.hostagent.settings.lendee.gpus is empty: list the GPUs the lendee borrows (labels from settings.gpus, or PCI addresses), e.g. lendee.gpus = [ "gpu-a" ];'';
      }
      {
        assertion =
          cfg.kubeconfigFile == null
          || (lib.hasPrefix "/" cfg.kubeconfigFile && !lib.hasPrefix "${builtins.storeDir}/" cfg.kubeconfigFile);
        message = "services.hostagent.kubeconfigFile must be an absolute path outside the Nix store, which anyone on the machine can read: keep the kubeconfig in e.g. /run/secrets or /var/lib/secrets.";
      }
      {
        assertion = cfg.kubeconfigFile == null || (cfg.settings.kubernetes.kubeconfig or null) == null;
        message = "services.hostagent: set kubeconfigFile or settings.kubernetes.kubeconfig, not both.";
      }
      {
        assertion = cfg.controlSocketGroup == null || (cfg.settings.control_group or null) == null;
        message = "services.hostagent: set controlSocketGroup or settings.control_group, not both.";
      }
      {
        assertion =
          cfg.mqttPasswordFile == null
          || (lib.hasPrefix "/" cfg.mqttPasswordFile && !lib.hasPrefix "${builtins.storeDir}/" cfg.mqttPasswordFile);
        message = "services.hostagent.mqttPasswordFile must be an absolute path outside the Nix store, which anyone on the machine can read: keep the password in e.g. /run/secrets or /var/lib/secrets.";
      }
      {
        assertion = cfg.mqttPasswordFile == null || (cfg.settings.mqtt.password_file or null) == null;
        message = "services.hostagent: set mqttPasswordFile or settings.mqtt.password_file, not both.";
      }
    ]
    ++ lib.mapAttrsToList (label: gpu: {
      assertion = gpu ? pci || gpu ? uuid; # settings drops the nulls
      message = ''services.hostagent.settings.gpus.${label} has neither pci nor uuid: give its PCI address as `lspci -D` shows it, e.g. pci = "0000:01:00.0"; (a GPU bound to vfio-pci needs it), or its uuid if NVML on the host sees it.'';
    }) cfg.settings.gpus
    # A Nix path literal (host_key = ./key) or one interpolated ("${./key}") is copied
    # into the store, where anyone on the machine can read it: a secret must stay a path
    # outside it, as a string.
    ++ lib.mapAttrsToList (key: secret: {
      assertion =
        let
          value = lib.attrByPath (lib.splitString "." key) null cfg.settings;
        in
        value == null || !(builtins.isPath value || lib.hasPrefix "${builtins.storeDir}/" "${toString value}");
      message = ''services.hostagent.settings.${key} is ${secret.what} in the Nix store, which anyone on the machine can read: give the path of a file outside it as a string, e.g. ${key} = "${secret.example}";${secret.instead} (a path literal such as ./file is copied into the store), and replace the ${secret.noun}, which others may have copied.'';
    }) {
      "ssh.host_key" = {
        what = "a private key";
        noun = "key";
        example = "/var/lib/hostagent/ssh_host_ed25519_key";
        instead = "";
      };
      "verify.ssh.key" = {
        what = "a private key";
        noun = "key";
        example = "/var/lib/hostagent/id_ed25519";
        instead = "";
      };
      "mqtt.password_file" = {
        what = "the broker's password";
        noun = "password";
        example = "/run/secrets/mqtt-password";
        instead = " or better, mqttPasswordFile (systemd hands it to the service as a credential)";
      };
      "kubernetes.kubeconfig" = {
        what = "a kubeconfig, a credential to the cluster,";
        noun = "credential";
        example = "/run/secrets/hostagent-kubeconfig";
        instead = " or better, kubeconfigFile (systemd hands it to the service as a credential)";
      };
    }
    ++ lib.mapAttrsToList (key: path: {
      assertion = (cfg.settings.${key} or path) == path;
      message = "services.hostagent.settings.${key} must stay ${path}: libvirtd runs the hook with a scrubbed environment, so the hook knows only that path.";
    }) hookPaths;

    # Linked into /var/lib/libvirt/hooks/qemu.d/ by the libvirtd module's libvirtd-config,
    # which runs when libvirtd starts, not at a switch (libvirtd is not restarted then):
    # a store path there would keep an upgraded host running the old hook, and a garbage
    # collection would take it away. /etc/hostagent/qemu-hook is pointed at the current
    # package by every activation. The hook has a store-path interpreter (nix/package.nix).
    virtualisation.libvirtd.hooks.qemu.hostagent = "/etc/hostagent/qemu-hook";
    environment.etc."hostagent/qemu-hook".source = "${cfg.package}/libexec/hostagent/qemu-hook";

    environment.etc."hostagent/config.toml".source = configFile;
    networking.firewall.allowedTCPPorts = lib.mkIf cfg.openFirewall openPorts;
    environment.systemPackages = [ cfg.package ];

    users.groups = lib.mkIf (cfg.controlSocketGroup != null) { ${cfg.controlSocketGroup} = { }; };

    systemd.services.hostagent = {
      description = "hostagent: lend idle passthrough GPUs to a Kubernetes worker VM";
      wantedBy = [ "multi-user.target" ];
      # Wants, not Requires: a libvirtd restart must not restart the agent (it
      # reconnects). After libvirt-guests: stopped before it at shutdown, so the
      # agent does not boot the lendee again while the VMs are being shut down.
      wants = [
        "libvirtd.service"
        "network-online.target"
      ];
      after = [
        "libvirtd.service"
        "network-online.target"
        "libvirt-guests.service"
      ];
      restartTriggers = [ configFile ];
      # On the watchdog's SIGABRT, every thread's stack goes to the journal.
      environment.PYTHONFAULTHANDLER = "1";

      serviceConfig = {
        Type = "notify";
        ExecStart = "${lib.getExe cfg.package} --config ${configPath} run";
        # The agent pings every 15 s from its event loop: a blocked loop is restarted.
        WatchdogSec = "30s";
        Restart = "on-failure";
        RestartSec = "5s";
        # 2: a configuration the agent refuses; restarting would only repeat it.
        RestartPreventExitStatus = 2;
        TimeoutStartSec = "2min";
        # A known descriptor budget: the connection caps (SSH, metrics, control) are
        # sized against it, so that a flood cannot take the descriptors the hook
        # socket and state saves need.
        LimitNOFILE = 4096;
        LoadCredential =
          lib.optional (cfg.kubeconfigFile != null) "kubeconfig:${cfg.kubeconfigFile}"
          ++ lib.optional (cfg.mqttPasswordFile != null) "mqtt-password:${cfg.mqttPasswordFile}";

        # hook.sock and control.sock, recreated at each start; while the agent is
        # down the hook spools under /var/lib/hostagent/spool instead.
        RuntimeDirectory = "hostagent";
        RuntimeDirectoryMode = "0755";
        StateDirectory = "hostagent";
        StateDirectoryMode = "0755";
        UMask = "0077";

        # Hardening: as in systemd/hostagent.service, where each line has its reason
        # (`systemd-analyze security` rates both 2.0; tests/packaging holds them there).
        # connect() to libvirt's socket needs no write access, so ProtectSystem=strict
        # needs no ReadWritePaths=.
        ProtectSystem = "strict";
        # Homes hidden but root's default kubeconfig (kubeconfigFile needs none).
        ProtectHome = "tmpfs";
        BindReadOnlyPaths = [ "-/root/.kube" ];
        PrivateTmp = true;
        PrivateMounts = true;
        NoNewPrivileges = true;
        # No host disks: pseudo-devices, and the NVIDIA nodes NVML talks to (char major
        # 195); BindPaths takes no glob, so GPUs 0-15, each ignored where absent.
        PrivateDevices = true;
        DevicePolicy = "closed";
        DeviceAllow = [ "char-nvidia-frontend rw" ];
        BindPaths = [ (lib.concatMapStringsSep " " (n: "-/dev/nvidia${n}") ([ "ctl" ] ++ map toString (lib.range 0 15))) ];
        # Nothing the agent can write can be run; it runs only systemctl, from the store.
        NoExecPaths = [ "/" ];
        ExecPaths = [ "/nix/store" ];
        # No CAP_DAC_READ_SEARCH: a file of another user's is refused by check-config.
        CapabilityBoundingSet = [
          "CAP_CHOWN"
          "CAP_NET_BIND_SERVICE"
        ];
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_INET"
          "AF_INET6"
        ];
        # The service set less @privileged and @resources, but chown (control.sock's group).
        SystemCallFilter = [
          "@system-service"
          "~@privileged @resources"
          "@chown"
        ];
        SystemCallErrorNumber = "EPERM";
        SystemCallArchitectures = "native";
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        ProtectProc = "invisible";
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        # Not ProcSubset=pid (NVML's /proc/driver/nvidia, the boot id) nor
        # MemoryDenyWriteExecute (libvirt's PCRE2 JIT maps writable and executable memory).
      };
    };
  };
}
