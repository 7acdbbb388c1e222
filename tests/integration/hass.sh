#!/bin/sh
# Installs the Home Assistant that tests/integration runs, once, into a virtual
# environment cached outside the clone (like the lab's Kubernetes), and prints its
# `hass`; prints nothing, and says why on stderr, where it cannot:
#
#   tests/integration/hass.sh
#
# Home Assistant 2025.4 is the last series that runs on Python 3.13 (later ones need
# 3.14); Debian 12 has 3.11, so the interpreter is a Python 3.13 the machine already
# has: HASS_PYTHON, else pyenv's, else python3.13 on PATH. The first install takes about
# 6 minutes and 1 GB on 2 cores.
set -eu
release=2025.4.4
pins="homeassistant==$release paho-mqtt==2.1.0 home-assistant-frontend==20250411.0"
cache=${HOSTAGENT_LAB_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hostagent-lab}
venv="$cache/hass-$release"
if [ -x "$venv/bin/hass" ] && [ "$(cat "$venv/pins" 2>/dev/null)" = "$pins" ]; then
    echo "$venv/bin/hass"
    exit 0
fi
python=${HASS_PYTHON:-}
if [ -n "$python" ] && ! [ -x "$python" ]; then
    echo "hass.sh: HASS_PYTHON=$python is not an interpreter: name a Python 3.13" >&2
    exit 1
fi
if [ -z "$python" ]; then
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 \
                     "$(command -v python3.13 || true)"; do
        if [ -x "$candidate" ]; then python=$candidate; break; fi
    done
fi
if [ -z "$python" ]; then
    echo "hass.sh: no Python 3.13 (set HASS_PYTHON, or install one with pyenv): the" \
         "real Home Assistant test will skip" >&2
    exit 0
fi
echo "installing Home Assistant $release with $python (once, cached in $venv)" >&2
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check $pins >&2 || {
    echo "hass.sh: pip could not install $pins into $venv (above, why)" >&2
    rm -rf "$venv"
    exit 1
}
echo "$pins" > "$venv/pins"
echo "$venv/bin/hass"
