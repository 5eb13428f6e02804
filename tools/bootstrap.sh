# Sourced by ./run and ./test: make .venv exist and hold the pinned dependencies.
#
#   CLAW_EXTRAS=test . tools/bootstrap.sh     # installs -e ".[test]" instead of -e .
#
# The install runs only when pyproject.toml or constraints.txt changed since the last one
# (a stamp in .venv holds their hash and the extras installed). PYTHON picks the interpreter
# that creates the venv (default: python3.11, then python3).

set -euo pipefail

CLAW_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLAW_VENV="${CLAW_ROOT}/.venv"
CLAW_EXTRAS="${CLAW_EXTRAS:-}"

_claw_log() { echo "[claw] $*" >&2; }

_claw_find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3.11 python3.12 python3; do
        [ -n "$candidate" ] || continue
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 13)))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

_claw_make_venv() {
    local python
    if ! python="$(_claw_find_python)"; then
        _claw_log "Python 3.11 or 3.12 is required (set PYTHON=/path/to/python3.11)."
        return 1
    fi
    _claw_log "creating ${CLAW_VENV} with ${python}"
    if "$python" -m venv "$CLAW_VENV" 2>/dev/null; then
        return 0
    fi
    # Debian without python3-venv has no ensurepip: make the venv bare and let the system's pip
    # install pip into it.
    rm -rf "$CLAW_VENV"
    "$python" -m venv --without-pip "$CLAW_VENV"
    if "$python" -m pip --version >/dev/null 2>&1; then
        "$python" -m pip --python "$CLAW_VENV/bin/python" install --quiet pip
        return 0
    fi
    rm -rf "$CLAW_VENV"
    _claw_log "cannot create a virtualenv: install Debian's python3-venv (apt-get install python3-venv)."
    return 1
}

_claw_stamp_hash() {
    cat "$CLAW_ROOT/pyproject.toml" "$CLAW_ROOT/constraints.txt" | sha256sum | cut -d' ' -f1
}

claw_bootstrap() {
    if [ ! -x "$CLAW_VENV/bin/python" ]; then
        _claw_make_venv
    fi
    local stamp="$CLAW_VENV/.claw-install-stamp" want have
    want="$(_claw_stamp_hash)"
    have="$(cat "$stamp" 2>/dev/null || true)"
    # The stamp is "<hash> <extras>"; an install with [test] also serves ./run.
    if [ "$have" = "$want ${CLAW_EXTRAS}" ] || { [ -z "$CLAW_EXTRAS" ] && [ "$have" = "$want test" ]; }; then
        return 0
    fi
    local target="."
    [ -n "$CLAW_EXTRAS" ] && target=".[${CLAW_EXTRAS}]"
    _claw_log "installing pinned dependencies: pip install -c constraints.txt -e \"${target}\""
    (cd "$CLAW_ROOT" && "$CLAW_VENV/bin/python" -m pip install --disable-pip-version-check -c constraints.txt -e "$target")
    echo "$want ${CLAW_EXTRAS}" >"$stamp"
}

claw_bootstrap
