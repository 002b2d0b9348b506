"""The persistent grid of a compiled GEMM on a device: one CTA per SM (one cluster per unit
of work, whole clusters), or fewer when there are fewer units. No DSL import once the device's
cluster occupancy is known (it is kept in gwgrad.kernel_cache's directory).

``cfg`` below is anything with ``num_units`` and the cluster shape (``cluster_m`` /
``cluster_n``): a kernel config, or a compiled GEMM (``backends`` ``CompiledGemm``), whose
cached kernel knows its units without the DSL.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

from . import kernel_cache
from .dsl import shielded_argv

__all__ = ["cluster_size", "whole_clusters", "grid_size", "grid_size_for_arch",
           "SM_COUNT_WITHOUT_GPU"]

#: SM counts assumed for a grid compiled in without the GPU present (the JAX custom call
#: bakes its grid size in; any value is correct, the device's own count the fastest).
SM_COUNT_WITHOUT_GPU = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}


def cluster_size(cfg: Any) -> int:
    return getattr(cfg, "cluster_m", 1) * getattr(cfg, "cluster_n", 1)


def whole_clusters(cfg: Any, resident_clusters: int) -> int:
    """The persistent grid in CTAs: one cluster per unit of work, at most ``resident_clusters``
    (with 1x1 clusters, the SMs)."""
    return min(cfg.num_units, resident_clusters) * cluster_size(cfg)


def grid_size(cfg: Any, device_id: int) -> int:
    """Persistent grid: one CTA per SM, or fewer when there are fewer units of work; with
    clusters, whole clusters, no more than can be resident at once (their leaders take units
    from the counter)."""
    size = cluster_size(cfg)
    resident = _sm_count(device_id) if size == 1 else _max_active_clusters(device_id, size)
    return whole_clusters(cfg, resident)


def grid_size_for_arch(cfg: Any, arch: str, device_id: int = 0) -> int:
    """``grid_size`` on ``device_id``, or for ``arch``'s usual SM count where no GPU is present
    (lowering a JAX custom call with ``CUTE_DSL_ARCH`` set)."""
    try:
        return grid_size(cfg, device_id)
    except RuntimeError:
        sms = SM_COUNT_WITHOUT_GPU.get(arch, 132)
        return whole_clusters(cfg, sms // cluster_size(cfg))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    from . import cuda as gcuda

    return gcuda.sm_count(device_id)


@functools.lru_cache(maxsize=None)
def _max_active_clusters(device_id: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one per SM, all of its shared memory) resident at once: the
    driver's occupancy answer through the DSL's HardwareInfo, learned once per device model,
    driver and size and then read from the kernel cache's directory (a process running cached
    kernels then never imports the DSL); SMs // size where the query fails."""
    from . import cuda as gcuda

    major, minor = gcuda.compute_capability(device_id)
    fact = (f"max_active_clusters {size} CTAs | {gcuda.device_name(device_id)} | "
            f"sm_{major}{minor} | {_sm_count(device_id)} SMs | driver {gcuda.driver_version()}")
    fallback = _sm_count(device_id) // size
    found = kernel_cache.remembered(fact, lambda: _query_max_active_clusters(device_id, size))
    return max(1, min(found, fallback))


def _query_max_active_clusters(device_id: int, size: int) -> Tuple[int, bool]:
    """(clusters, True) from the DSL's HardwareInfo, or (SMs // size, False) when the DSL or
    the query is not available (not kept: a later process asks again)."""
    try:
        from . import cuda as gcuda
        import cutlass.utils as cutlass_utils

        with gcuda.on_device(device_id), shielded_argv():
            return int(cutlass_utils.HardwareInfo(device_id).get_max_active_clusters(size)), True
    except Exception:  # no DSL here, or the query failed: every SM can hold one CTA
        return _sm_count(device_id) // size, False
