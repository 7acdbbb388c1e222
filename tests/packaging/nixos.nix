# What tests/packaging/test_nix.py reads from NixOS evaluations of the module, in one
# nix-instantiate run: each NixOS evaluation costs seconds, most of it shared here.
#
#   nix-instantiate --eval --strict --json tests/packaging/nixos.nix \
#     --arg nixosEval ../shared/nixos-eval/eval.nix --arg readme CONFIGURATION.nix
#
# `readme` is the README's NixOS example as written (it imports
# ./hostagent/nix/module.nix from beside it); every other case imports `module`, and
# `flake`'s checks get nixos-eval as their nixpkgs input.
{
  nixosEval,
  readme,
  module ? ../../nix/module.nix,
  flake ? ../../flake.nix,
}:

let
  # Python dependencies that nixos-eval's trimmed tree names but lacks the files of, stood
  # in for as its own overlay does (they evaluate, they cannot build): pyproject.toml
  # gained them after the tree was made.
  standIns = {
    nixpkgs.overlays = [
      (final: prev: {
        pythonPackagesExtensions = prev.pythonPackagesExtensions ++ [
          (pyfinal: pyprev: {
            aiomqtt =
              derivation {
                name = "python3-aiomqtt-stub";
                system = "x86_64-linux";
                builder = "/bin/sh";
                args = [ "-c" "exit 1" ];
              }
              // {
                pname = "aiomqtt";
                version = "0-stub";
                pythonModule = pyfinal.python;
                pythonPath = [ ];
                requiredPythonModules = [ ];
                meta = { };
              };
          })
        ];
      })
    ];
  };
  evalNixos = modules: import nixosEval { modules = modules ++ [ standIns ]; };
  inherit ((evalNixos [ ]).lib) filterAttrs hasPrefix hasSuffix mapAttrs;

  # Only this module's assertions (reading every message would evaluate NixOS's own
  # for configurations they do not concern).
  ours =
    sys:
    builtins.concatMap (d: d.value) (
      builtins.filter (d: hasSuffix "nix/module.nix" d.file) sys.options.assertions.definitionsWithLocations
    );
  assertions = sys: {
    failed = map (a: a.message) (builtins.filter (a: !a.assertion) (ours sys));
    all = map (a: a.message) (ours sys);
  };

  # What the module does with a configuration: everything test_nix.py compares.
  outcome =
    e:
    let
      c = e.sys.config;
      etc = c.environment.etc."hostagent/config.toml".source;
    in
    assertions e.sys
    // {
      toplevel = e.toplevelDrvPath;
      warnings = e.warnings;
      settings = c.services.hostagent.settings;
      unit = c.systemd.units."hostagent.service".text;
      hook = c.virtualisation.libvirtd.hooks.qemu.hostagent;
      hookTarget = c.environment.etc."hostagent/qemu-hook".source;
      # The libvirtd module links each hook into qemu.d/ from this script.
      libvirtdConfig = c.systemd.services.libvirtd-config.script;
      # The checked file: the script that runs the agent on it, and the TOML as JSON.
      check = etc.buildCommand;
      config = builtins.fromJSON etc.configFile.value;
      groups = builtins.attrNames c.users.groups;
      ports = c.networking.firewall.allowedTCPPorts;
    };

  # An option type as the comparison with hostagent/core/config.py needs it.
  describeType =
    t:
    if t.name == "nullOr" then
      describeType t.nestedTypes.elemType // { nullable = true; }
    else
      {
        kind = t.name;
        nullable = false;
      }
      // (if t.name == "enum" then { values = t.functor.payload.values or t.functor.payload; } else { })
      // (
        if t.name == "listOf" || t.name == "attrsOf" then
          { elem = describeType t.nestedTypes.elemType; }
        else
          { }
      )
      // (
        if t.name == "submodule" then
          let
            sub = t.getSubOptions [ ];
          in
          {
            options = describeOptions sub;
            freeform = sub ? _freeformOptions;
          }
        else
          { }
      )
      # Which of these integers the type takes (the agent's bounds must agree).
      // (if t.name == "int" || builtins.match ".*Int.*" t.name != null then
        { takes = map t.check [ (-1) 0 1 2 ]; }
      else
        { });

  describeOptions =
    options:
    mapAttrs (
      _: o:
      describeType o.type
      // {
        hasDefault = o ? default;
        default = o.default or null;
        description = o.description or "";
      }
    ) (filterAttrs (name: o: !hasPrefix "_" name && o._type or "" == "option") options);

  gpu-a = {
    pci = "0000:01:00.0";
  };

  cases = {
    # libvirtd off, no lendee, the hook's paths moved, the kubeconfig in the store.
    nothing = evalNixos [
      module
      {
        services.hostagent = {
          enable = true;
          settings.hook_socket = "/srv/hook.sock";
          settings.state_dir = "/srv/hostagent";
          kubeconfigFile = "/nix/store/00000000000000000000000000000000-kubeconfig";
          mqttPasswordFile = "/nix/store/00000000000000000000000000000000-mqtt-password";
        };
      }
    ];
    # Private keys in the store: one as a path literal (copied there), one named there.
    store = evalNixos [
      module
      {
        virtualisation.libvirtd.enable = true;
        services.hostagent = {
          enable = true;
          settings = {
            lendee = {
              domain = "gpu-node";
              gpus = [ "gpu-a" ];
            };
            gpus = { inherit gpu-a; };
            ssh.host_key = ./ssh_host_ed25519_key;
            verify.ssh.key = "/nix/store/00000000000000000000000000000000-id_ed25519";
            mqtt.password_file = ./mqtt-password;
            kubernetes.kubeconfig = "/nix/store/00000000000000000000000000000000-kubeconfig";
          };
        };
      }
    ];
    # Each convenience set twice; a GPU with neither address nor UUID.
    twice = evalNixos [
      module
      {
        virtualisation.libvirtd.enable = true;
        services.hostagent = {
          enable = true;
          settings = {
            lendee = {
              domain = "gpu-node";
              gpus = [ "gpu-a" ];
            };
            gpus.gpu-a.name = "RTX 3050";
            kubernetes.kubeconfig = "/etc/rancher/k3s/k3s.yaml";
            control_group = "wheel";
            mqtt.password_file = "/etc/hostagent/mqtt-password";
          };
          kubeconfigFile = "secrets/kubeconfig";
          mqttPasswordFile = "/run/secrets/mqtt";
          controlSocketGroup = "hostagent";
        };
      }
    ];
  };
in
{
  readme = outcome (evalNixos [ readme ]);

  # A GPU by UUID alone, as the agent takes it; a free-form key passes through.
  uuid = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        settings = {
          lendee = {
            domain = "gpu-node";
            gpus = [ "gpu-d" ];
          };
          gpus.gpu-d.uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000004";
          timeouts.drain = "10m";
        };
      };
    }
  ]);

  # Two worker VMs, lendees.NAME alone: no [lendee] in the file.
  lendees = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        settings = {
          lendees.gpu-node-a.gpus = [ "gpu-a" ];
          lendees.gpu-node-b = {
            gpus = [ "0000:02:00.0" ];
            node = "k8s-b";
          };
          gpus = { inherit gpu-a; };
        };
      };
    }
  ]);

  # Home Assistant over MQTT: the password a credential, the rest free-form settings.
  mqtt = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        settings = {
          lendee = {
            domain = "gpu-node";
            gpus = [ "gpu-a" ];
          };
          gpus = { inherit gpu-a; };
          owners.gaming1.gpus = [ "gpu-a" ];
          mqtt = {
            broker = "mqtts://broker.lan:8883";
            username = "hostagent";
            vms = [ "gaming1" ];
          };
        };
        mqttPasswordFile = "/run/secrets/hostagent-mqtt";
      };
    }
  ]);

  # A key the agent refuses evaluates (free-form), and so does the build's check of it.
  typo = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        settings = {
          lendee = {
            domain = "gpu-node";
            gpus = [ "gpu-a" ];
          };
          gpus = { inherit gpu-a; };
          policy.relend_dealy = "1m";
        };
      };
    }
  ]);

  # openFirewall: the SSH button's port and the metrics' (a port number, ":port"), and
  # nothing for a listener on loopback alone.
  firewall = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        openFirewall = true;
        settings = {
          lendee = {
            domain = "gpu-node";
            gpus = [ "gpu-a" ];
          };
          gpus = { inherit gpu-a; };
          ssh.listen = 2222;
          metrics.listen = ":9477";
        };
      };
    }
  ]);
  firewallLoopback = outcome (evalNixos [
    module
    {
      virtualisation.libvirtd.enable = true;
      services.hostagent = {
        enable = true;
        openFirewall = true;
        settings = {
          lendee = {
            domain = "gpu-node";
            gpus = [ "gpu-a" ];
          };
          gpus = { inherit gpu-a; };
          ssh.listen = "[::]:2022";
          metrics.listen = "127.0.0.1:9477";
        };
      };
    }
  ]);

  # The package option as lib.mkPackageOption makes it.
  package =
    let
      o = (evalNixos [ module ]).sys.options.services.hostagent.package;
    in
    {
      defaultText = o.defaultText.text;
      inherit (o) description;
      type = o.type.name;
    };

  assertions = mapAttrs (_: e: assertions e.sys) cases;

  # The flake's checks, with this tree standing in for its nixpkgs input.
  checks =
    let
      base = evalNixos [ ];
      nixpkgs = {
        lib = base.lib // {
          nixosSystem = { modules }: (evalNixos modules).sys;
        };
        legacyPackages.x86_64-linux = base.sys.pkgs;
      };
      outputs = (import flake).outputs {
        self = outputs // {
          outPath = dirOf flake;
        };
        inherit nixpkgs;
      };
      checks = outputs.checks.x86_64-linux;
    in
    {
      names = builtins.attrNames checks;
      package = checks.package.drvPath;
      example = checks.example-config.drvPath;
      exampleCheck = checks.example-config.buildCommand;
    };

  settings = describeType (evalNixos [ module ]).sys.options.services.hostagent.settings.type;
}
