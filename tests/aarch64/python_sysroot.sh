#!/usr/bin/env bash
# An aarch64 CPython 3.11 with TVM, run under qemu-aarch64: the ARM RPC server of
# tests/test_remote_tuning.py.  Debian bookworm's arm64 Python packages are fetched with
# apt's own client into a private package list (the system's dpkg is not touched) and
# unpacked into DEST/root; TVM and its dependencies are pip's aarch64 wheels in DEST/site;
# DEST/python starts it (qemu-aarch64 -cpu max), and can start itself again: there is no
# binfmt_misc, so the Python's own path must be that script, not the aarch64 binary.
#
# Usage: tests/aarch64/python_sysroot.sh DEST   (needs qemu-user, apt and the network)
set -euo pipefail
dest=$(realpath -m "${1:?usage: $0 DEST}")
pip=${PIP:-$(dirname "$0")/../../.venv/bin/pip}
mkdir -p "$dest/apt/lists/partial" "$dest/apt/cache/archives/partial" "$dest/root" "$dest/debs"
apt_opts=(-o "Dir::State::Lists=$dest/apt/lists" -o "Dir::Cache=$dest/apt/cache"
          -o "Dir::State::status=/dev/null" -o APT::Architecture=arm64
          -o APT::Architectures=arm64 -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" -qq update
(cd "$dest/debs" && apt-get "${apt_opts[@]}" -qq download python3.11-minimal \
  libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6 zlib1g libexpat1 \
  libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 \
  libuuid1 libzstd1 2>/dev/null)
for deb in "$dest"/debs/*.deb; do dpkg -x "$deb" "$dest/root"; done
"$pip" install -q --target "$dest/site" --platform manylinux_2_28_aarch64 --only-binary=:all: \
  --python-version 3.11 apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1 numpy ml_dtypes \
  typing_extensions cloudpickle psutil
cat > "$dest/python" <<SCRIPT
#!/bin/sh
PYTHONPATH="$dest/site" exec qemu-aarch64 -cpu max -L "$dest/root" -0 "$dest/python" \
  "$dest/root/usr/bin/python3.11" "\$@"
SCRIPT
chmod +x "$dest/python"
"$dest/python" -c "import platform, tvm; print(platform.machine(), 'TVM', tvm.__version__)"
