# Sourced by the setup scripts: what a script needs, and installing it where that is possible.
#
#   need_pkg KIND PACKAGE TEST...   records PACKAGE (Debian/Ubuntu name) when the command TEST fails;
#                                   KIND is "required" or "optional"
#   install_needed                  tries to install every recorded package (apt-get, as root or
#                                   through sudo, each package on its own, bounded in time), then
#                                   checks each TEST again
#   missing_required, missing_optional   the packages still missing afterwards (arrays)
#
# Nothing here is fatal: without a network, without root or without apt-get the packages simply
# stay missing, and the calling script says what that means for it.

pkg_kinds=(); pkg_names=(); pkg_tests=()
missing_required=(); missing_optional=()

need_pkg() {  # need_pkg KIND PACKAGE TEST...
  local kind=$1 name=$2; shift 2
  "$@" >/dev/null 2>&1 && return 0
  pkg_kinds+=("$kind"); pkg_names+=("$name"); pkg_tests+=("$*")
}

have_header() {  # have_header PATH: a header in the compilers' usual include folders
  [ -f "/usr/include/$1" ] || [ -f "/usr/local/include/$1" ]
}

apt_install_one() {  # apt_install_one PACKAGE: returns non-zero when it could not
  command -v apt-get >/dev/null || return 1
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || return 1
    sudo=(sudo -n)
  fi
  if [ -z "${apt_updated:-}" ]; then  # once per script; without a network this fails quickly
    apt_updated=1
    timeout 120 "${sudo[@]}" apt-get update -qq >/dev/null 2>&1 || true
  fi
  DEBIAN_FRONTEND=noninteractive timeout 600 "${sudo[@]}" apt-get install -y -qq \
    --no-install-recommends "$1" >/dev/null 2>&1
}

install_needed() {
  local i
  missing_required=(); missing_optional=()
  [ ${#pkg_names[@]} -eq 0 ] && return 0
  echo "setup: installing ${pkg_names[*]}"
  for i in "${!pkg_names[@]}"; do
    apt_install_one "${pkg_names[$i]}" || true
    # shellcheck disable=SC2086  # the test is a command line
    if ! eval "${pkg_tests[$i]}" >/dev/null 2>&1; then
      if [ "${pkg_kinds[$i]}" = required ]; then missing_required+=("${pkg_names[$i]}")
      else missing_optional+=("${pkg_names[$i]}"); fi
    fi
  done
  pkg_kinds=(); pkg_names=(); pkg_tests=()
}

skipped() {  # skipped WHO WHAT: says that WHO left WHAT out; in CI ($CI set) that is an error
  echo "$1: skipped: $2"
  if [ -n "${CI:-}" ]; then
    echo "$1: CI runs every part: install what is missing in .ci/run" >&2
    exit 1
  fi
}
