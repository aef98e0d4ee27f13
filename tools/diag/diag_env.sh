# Sourced from the repository root by the diagnosis scripts (serve_diag.sh, graph_diag.sh):
#   . tools/diag/diag_env.sh DEFAULT-OUT-DIR [build-dir]
# sets the environment of a GPU run (cuBLASLt from the CUDA toolkit, eager module loading, waits
# bounded at 3 s unless EPX_TIMEOUT_MS says otherwise), $build (default build) and $out ($OUT,
# else DEFAULT-OUT-DIR), which it creates.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CUDA_MODULE_LOADING=EAGER EPX_TIMEOUT_MS=${EPX_TIMEOUT_MS:-3000}
build=${2:-build}
out=${OUT:-$1}
mkdir -p "$out"
