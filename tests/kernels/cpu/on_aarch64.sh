#!/usr/bin/env bash
# The CPU kernels' tests on an ARM (AArch64 NEON) build, on an x86-64 Debian/Ubuntu host: an AArch64 Python
# run by qemu-user, the library built by the AArch64 cross gcc (-march=native read as -mcpu=neoverse-n1, a
# Graviton 2). What it checks: the NEON branches of lmq_kernels.triton/*.c compile, and every kernel's results
# against float64 references, batched = alone, the C step against the per-op one, the quantized dtypes' and
# calibration's greedy tokens, on that build. Not its speed (emulated). Not part of `pytest -q`: it needs
# root for apt, the network once, and ~1.7 GB under $LMQ_AARCH64_DIR.
#
#   bash tests/kernels/cpu/on_aarch64.sh                      # the CPU kernel test files
#   bash tests/kernels/cpu/on_aarch64.sh tests/kernels/cpu/test_cpu_kernels.py -k attention
#   bash tests/kernels/cpu/on_aarch64.sh -x -rfE                # options for pytest, the CPU kernel test files
#
# Setup (first run): apt installs gcc-aarch64-linux-gnu and qemu-user-static; apt-get download + dpkg -x
# put Debian's arm64 python3.11 in a sysroot; pip downloads the AArch64 wheels of torch (2.7.1: the last
# CPU-only AArch64 wheel on PyPI) and the compiled packages it imports (numpy, tokenizers, ...); the others
# are linked from the virtual environment that runs this script (python3 on the PATH).
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROOT=${LMQ_AARCH64_DIR:-$HOME/.cache/lmq/aarch64}
SYSROOT=$ROOT/sysroot SITE=$ROOT/site STUB=$ROOT/stub
mkdir -p "$ROOT"

if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
    apt-get install -y -q gcc-aarch64-linux-gnu libgomp1-arm64-cross qemu-user-static >/dev/null
fi

if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
    dpkg --print-foreign-architectures | grep -q arm64 || { dpkg --add-architecture arm64 && apt-get update -q >/dev/null; }
    mkdir -p "$ROOT/debs" "$SYSROOT"
    (cd "$ROOT/debs" && for p in python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libexpat1 zlib1g \
        libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libcrypt1 \
        libgcc-s1 libstdc++6 libgomp1 libdb5.3 libgdbm6 libnsl2 libtirpc3; do apt-get download -q "$p:arm64" >/dev/null; done)
    for d in "$ROOT"/debs/*.deb; do dpkg -x "$d" "$SYSROOT"; done
fi

if [ ! -d "$SITE/torch" ]; then
    mkdir -p "$ROOT/wheels" "$SITE"
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
        --platform manylinux2014_aarch64 --python-version 3.11 --implementation cp --abi cp311 -d "$ROOT/wheels" \
        torch==2.7.1 numpy tokenizers safetensors regex pyyaml markupsafe charset-normalizer
    for w in "$ROOT"/wheels/*.whl; do (cd "$SITE" && python3 -m zipfile -e "$w" .); done
    # every other pure-Python package of this environment, with its metadata (transformers checks versions);
    # one with an x86-64 extension (and its metadata) left out: an import of it fails as not installed
    host=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for p in "$host"/*; do
        b=$(basename "$p")
        case $b in __pycache__|*.pth|*.so) continue ;; esac
        [ -e "$SITE/$b" ] && continue
        if [ -d "$p" ] && [[ $b == *.dist-info ]]; then
            grep -q '\.so,' "$p/RECORD" 2>/dev/null && continue
        elif [ -d "$p" ]; then
            [ -n "$(find "$p" -name '*.so' -print -quit)" ] && continue
        fi
        ln -s "$p" "$SITE/$b"
    done
fi

# triton has no part in the CPU kernels; lmq_kernels.triton' package imports it: a stand-in that imports
mkdir -p "$STUB/triton"
cat > "$STUB/triton/__init__.py" <<'EOF'
class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any()
    def __getattr__(self, name): return _Any()
    def __getitem__(self, key): return _Any()
def jit(fn=None, **kwargs): return fn if fn is not None else (lambda f: f)
def __getattr__(name): return _Any()
EOF
printf 'from . import _Any\ndef __getattr__(name): return _Any()\n' > "$STUB/triton/language.py"

# the cross compiler as the host's: -march=native means the emulated CPU
cat > "$ROOT/cc" <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do [ "$a" = "-march=native" ] && a="-mcpu=neoverse-n1"; args+=("$a"); done
exec aarch64-linux-gnu-gcc "${args[@]}"
EOF
chmod +x "$ROOT/cc"
mkdir -p "$ROOT/cache"
# the default model's converted folder, where this host has it (converting it under emulation takes long)
[ -d "$ROOT/cache/SmolLM2-135M-Instruct" ] || cp -r "${LMQ_CACHE_DIR:-$HOME/.cache/lmq}/SmolLM2-135M-Instruct" "$ROOT/cache/" 2>/dev/null || true

export PYTHONPATH=$SITE:$STUB:$PWD/tests:$PWD CC=$ROOT/cc LMQ_CACHE_DIR=$ROOT/cache PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
named=0   # test files among the arguments: else the CPU kernels' files, with the arguments as pytest options
for a in "$@"; do [[ $a == tests/* ]] && named=1; done
[ $named = 1 ] || set -- "$@" tests/kernels/cpu/test_cpu_kernels.py tests/kernels/cpu/test_cpu_prefill_attention.py tests/engine/test_cpu_step.py \
    tests/engine/test_quantized.py tests/kernels/cpu/test_cpu_calibration.py
exec qemu-aarch64-static -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" -m pytest -p pytest_asyncio.plugin \
    -p no:cacheprovider -q "$@"
