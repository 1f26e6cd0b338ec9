#!/usr/bin/env bash
# A headless browser for tests/test_browser.py: Debian's chromium driven by Playwright.
# Playwright cannot download its own browser here (no CDN), so the test points it at /usr/bin/chromium.
#   --system  only the system package (chromium from apt), e.g. before the venv that playwright goes into exists
set -euo pipefail

if ! command -v chromium >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
chromium --version
[[ "${1:-}" == "--system" ]] && exit 0
python3 -c "import playwright" 2>/dev/null || python3 -m pip install -q playwright
python3 -c "from importlib.metadata import version; print('playwright', version('playwright'))"
