"""The name ``cudnn`` resolving to gwgrad's implementation of cuDNN frontend's grouped-GEMM
wgrad API, for running cuDNN frontend's own tests against gwgrad (run.sh)."""

from gwgrad import (  # noqa: F401
    GroupedGemmWgradSm100,
    get_grouped_gemm_wgrad_workspace_size_sm100,
    grouped_gemm_wgrad_wrapper_sm100,
)


def backend_version():
    raise RuntimeError("gwgrad stands in for cuDNN frontend's grouped GEMM wgrad API only")
