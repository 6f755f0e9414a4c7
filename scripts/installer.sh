# Sourced by the setup scripts: how they install into a virtual environment.
#
#   kvl_installer VENV      sets INSTALL (an install command into VENV, arguments as pip's) and UNINSTALL
#
# uv (pinned, one small wheel put into VENV by pip) installs in parallel and resolves in seconds: the SGLang
# environment took 400 s through pip and takes about 40 s through uv on the 2-core machine, same versions (a
# `pip freeze` of both differs in nothing). uv does not read pip's configuration, and this machine's pip
# configuration is what finds the wheels on disk and caps torch (its constraints file), so it is carried over:
# every index, find-links, constraint, certificate and timeout that `pip config list` shows (files and PIP_*
# variables) becomes the matching UV_* variable, unless that is set already. uv considers every index as pip does
# (unsafe-best-match) and writes bytecode as pip does (the first `vllm serve` of a test does not compile it).
# A uv that cannot be installed falls back to pip itself.

uv_version="0.13.8"

_kvl_pip_config_to_uv() {
    local python="$1" key value
    while IFS='=' read -r key value; do
        value="${value#\'}"
        value="${value%\'}"
        case "${key##*.}" in
            index-url) export UV_INDEX_URL="${UV_INDEX_URL:-$value}" ;;
            extra-index-url) export UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-$value}" ;;
            find-links) export UV_FIND_LINKS="${UV_FIND_LINKS:-${value// /,}}" ;;  # uv: comma-separated
            constraint | constraints) export UV_CONSTRAINT="${UV_CONSTRAINT:-$value}" ;;
            cert) export SSL_CERT_FILE="${SSL_CERT_FILE:-$value}" ;;
            timeout | default-timeout) export UV_HTTP_TIMEOUT="${UV_HTTP_TIMEOUT:-$value}" ;;
        esac
    done < <("$python" -m pip config list 2>/dev/null)
}

kvl_installer() {
    local venv="$1"
    local python="$venv/bin/python"
    INSTALL=("$python" -m pip install --disable-pip-version-check)
    UNINSTALL=("$python" -m pip uninstall --disable-pip-version-check -y)
    if [[ ! -x "$venv/bin/uv" ]] || [[ "$("$venv/bin/uv" --version 2>/dev/null)" != "uv $uv_version"* ]]; then
        "$python" -m pip install --disable-pip-version-check -q "uv==$uv_version" 2>/dev/null \
            || { echo "installer: uv==$uv_version could not be installed; pip installs instead" >&2; return 0; }
    fi
    _kvl_pip_config_to_uv "$python"
    export UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}"
    export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
    INSTALL=("$venv/bin/uv" pip install --python "$python")
    UNINSTALL=("$venv/bin/uv" pip uninstall --python "$python")
}
