#!/usr/bin/env bash
# The class server's proxy for tests/test_hub.py: JupyterHub's configurable-http-proxy, from npm (Node.js from
# Debian's apt when missing). JupyterHub itself comes with the project's dev extra (pyproject.toml).
set -euo pipefail

# openssl: tests/test_hub.py serves the hub over HTTPS with a certificate it makes
if ! command -v npm >/dev/null || ! command -v openssl >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm openssl
fi
command -v configurable-http-proxy >/dev/null || npm install -g --no-fund --no-audit configurable-http-proxy
configurable-http-proxy --version
