# Sourced by scripts/helm-lint.sh and scripts/helm (from the repository root): makes sure VENV
# (target/helm-lint/venv) holds Helm's library, from the PyPI package helm-sdkpy (Python
# bindings over Helm's Go library; it asks for a newer Python than Debian's but works with
# --ignore-requires-python), and PyYAML. On a fresh Debian machine (CI, as root) python3-venv is
# installed with apt-get first.
HELM_SDKPY_VERSION=0.1.32
PYYAML_VERSION=6.0.2
VENV=target/helm-lint/venv

if ! "$VENV/bin/python" -c 'import helm_sdkpy, yaml' >/dev/null 2>&1; then
  echo "== installing helm-sdkpy $HELM_SDKPY_VERSION into $VENV" >&2
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    else
      echo "python3 with the venv module is needed (Debian: apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --ignore-requires-python \
    "helm-sdkpy==$HELM_SDKPY_VERSION" "PyYAML==$PYYAML_VERSION"
fi
