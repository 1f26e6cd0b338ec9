#!/usr/bin/env bash
# A headless browser for tests/test_browser.py: Debian's chromium driven by Playwright.
# Playwright cannot download its own browser here (no CDN), so the test points it at /usr/bin/chromium.
set -euo pipefail

if ! command -v chromium >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core
fi
python3 -c "import playwright" 2>/dev/null || python3 -m pip install -q playwright
chromium --version
python3 -c "from importlib.metadata import version; print('playwright', version('playwright'))"
