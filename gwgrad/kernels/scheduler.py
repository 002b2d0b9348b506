"""Units and how the CTAs take them.

Work decomposition. The output is E stacked (hidden x intermediate) matrices; a *unit* is one
(expert, m-tile, n-tile) output tile, so there are E * tiles_m * tiles_n units, all static.
Units are numbered expert-rank-major: rank r holds the r-th longest expert (ties by index;
the prep work writes the order, kernels/prep.py), so handing units out in increasing order
runs the longest tiles first, and tiles of one expert run side by side and share its A/B
K-panels through L2. Inside an expert, units go in bands of a few m-tiles, m fastest inside a
band (unit_tile_coords).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .config import Workspace


@cute.jit
def decode_unit(cfg: cutlass.Constexpr, unit: Int32, ws: Workspace):
    """unit -> (expert, tile_m, tile_n, begin, k_tiles)."""
    rank = unit // cfg.tiles_per_expert
    local = unit - rank * cfg.tiles_per_expert
    expert = ws.order[rank]
    begin = ws.ranges[2 * expert]
    end = ws.ranges[2 * expert + 1]
    k_tiles = (end - begin + (cfg.tile_k - 1)) // cfg.tile_k
    tile_m, tile_n = unit_tile_coords(cfg, local)
    return expert, tile_m, tile_n, begin, k_tiles


@cute.jit
def unit_tile_coords(cfg: cutlass.Constexpr, local: Int32):
    """(tile_m, tile_n) of the local-th unit of an expert.

    Bands of `raster_group` m-tiles, m fastest inside a band: the ~one-per-SM units running at
    once then cover a few rows and columns of the expert's output and share their A and B
    K-panels through L2 (n fastest over a wide output, e.g. 112 n-tiles, would stream every B
    panel for each row of A)."""
    g = cfg.raster_group
    band_size = g * cfg.tiles_n
    band = local // band_size
    in_band = local - band * band_size
    if cutlass.const_expr(cfg.tiles_m % g == 0):
        tile_n = in_band // g
        tile_m = band * g + in_band - tile_n * g
    else:
        rows = Int32(g)
        if band >= cfg.tiles_m // g:
            rows = Int32(cfg.tiles_m % g)
        tile_n = in_band // rows
        tile_m = band * g + in_band - tile_n * rows
    return tile_m, tile_n
