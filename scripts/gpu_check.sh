#!/usr/bin/env bash
# The GPU checks behind docs/benchmarks.md's GPU section: the CUDA tests and bench/gpu_bench.py,
# on a machine with an NVIDIA GPU and a python3 that has torch (CUDA) and transformers.
#
#   scripts/gpu_check.sh [PART...]
#
# PART (default: probe tests bench):
#   probe          the GPU, the packages, which flash-attn API imports
#   models         write the benchmark's checkpoints (tiny, bench, bench-1b) into $MODELS
#   tests          pytest on the GPU tests (tests/gpu, tests/service/test_flash_attn.py)
#   bench          bench/gpu_bench.py, every part
#   bench-hf       its bandwidth and transformers parts only
#   bench-kvserve  its agreement and kvserve parts only
#   profile        bench/forward_profile.py on bench-1b (from $MODELS) at 64 and 256 sequences
#
# Environment:
#   RESULTS=DIR     logs and gpu_bench.json (default ./gpu-results); gpu_bench.json accumulates
#   MODELS=DIR      the generated checkpoints, kept between runs (default $RESULTS/models)
#   WHEELS=DIR      unpack every wheel in DIR onto a private path first, for a machine with no
#                   package index (flash-attn 4 and its CuTe DSL, grpcio and protobuf as kvserve
#                   needs them); the last wheel of a name wins
#   EXTRA_SITE=DIR  a folder of already unpacked packages, laid over that path
#   TESTS_TIMEOUT, BENCH_TIMEOUT, PROFILE_TIMEOUT   seconds each part may take (default 300, 900, 60)
#   PROFILE_ARGS   more bench/forward_profile.py arguments (--cuda-graphs, say)
#   BENCH_ARGS     more bench/gpu_bench.py arguments (--attention-backend torch, say)
#   BENCH_JSON     its results file (default $RESULTS/gpu_bench.json)
#
# kvserve itself comes from this checkout: where `import kvserve` fails, the package is laid out
# as setup.py maps it, with links into the checkout, on the same private path.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RESULTS="${RESULTS:-$ROOT/gpu-results}"
MODELS="${MODELS:-$RESULTS/models}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULTS" "$MODELS"
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1

SITE="$(mktemp -d /tmp/kvserve-gpu-site.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
if [ -n "${WHEELS:-}" ]; then
    for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done
fi
if [ -n "${EXTRA_SITE:-}" ]; then
    cp -a "$EXTRA_SITE"/. "$SITE"/
fi
# Wheels' .pth files are not read from PYTHONPATH: the CuTe DSL's names its packages' folder.
PYPATH="$SITE"
[ -d "$SITE/nvidia_cutlass_dsl/dsl_packages" ] && PYPATH="$PYPATH:$SITE/nvidia_cutlass_dsl/dsl_packages"
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
# kvserve from this checkout: an installed one elsewhere (another checkout's editable install) is not it.
if ! "$PY" -c "import sys, kvserve.model_service as m; sys.exit(not m.__file__.startswith(sys.argv[1]))" "$ROOT" 2>/dev/null; then
    mkdir -p "$SITE/kvserve"
    for entry in "$ROOT"/protos/kvserve/*; do ln -s "$entry" "$SITE/kvserve/"; done
    for folder in services kvcache_service model_service clients; do ln -s "$ROOT/$folder" "$SITE/kvserve/$folder"; done
fi

probe() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "grpcio", "protobuf", "flash-attn-4", "flash-attn", "nvidia-cutlass-dsl"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "-")
import kvserve.model_service.attention.flash_attn_backend as fa
api = fa.load_flash_api()
print("flash-attn API:", None if api is None else api.version, "| backend:", fa.why_not_flash() or "usable")
if api is None:
    try:
        import flash_attn.cute  # noqa: F401  (why not, in full)
    except Exception as exc:
        print("flash_attn.cute:", type(exc).__name__, exc)
EOF
}

run_tests() {
    timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu tests/service/test_flash_attn.py \
        2>&1 | tee "$RESULTS/gpu_tests.log"
}

run_bench() {
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    timeout "${BENCH_TIMEOUT:-900}" "$PY" bench/gpu_bench.py --model-dir "$MODELS" \
        --json "${BENCH_JSON:-$RESULTS/gpu_bench.json}" ${BENCH_ARGS:-} "$@" \
        2>&1 | tee -a "$RESULTS/gpu_bench.log"
}

status=0
for part in "${@:-probe tests bench}"; do
    for p in $part; do
        echo "=== $p"
        case "$p" in
            probe) probe ;;
            models) "$PY" -c "import sys; from kvserve.model_service.tiny_model import make_preset
for name in ('tiny', 'bench', 'bench-1b'):
    make_preset(sys.argv[1] + '/' + name, name)" "$MODELS" ;;
            tests) run_tests ;;
            bench) run_bench ;;
            bench-hf) run_bench --parts bandwidth hf ;;
            bench-kvserve) run_bench --parts agreement kvserve ;;
            profile) for batch in 64 256; do
                         timeout "${PROFILE_TIMEOUT:-60}" "$PY" bench/forward_profile.py --device cuda \
                             --model "$MODELS/bench-1b" --batch "$batch" --context 600 ${PROFILE_ARGS:-} 2>&1 | tee -a "$RESULTS/profile.log"
                     done ;;
            *) echo "unknown part $p" >&2; exit 2 ;;
        esac
        rc=$?
        [ $rc -ne 0 ] && { echo "=== $p failed ($rc)"; status=$rc; }
    done
done
exit $status
