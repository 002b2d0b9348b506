"""The benchmark's pieces that need no GPU: token distributions and the table."""

import pytest

from gwgrad.bench import format_table, token_counts


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@pytest.mark.parametrize("tokens,experts", [(65536, 32), (131072, 128), (32768, 8)])
def test_token_counts_sum_and_rounding(dist, tokens, experts):
    counts = token_counts(tokens, experts, dist)
    assert len(counts) == experts and sum(counts) == tokens
    assert all(c % 256 == 0 and c >= 0 for c in counts)
    if dist == "uniform":
        assert len(set(counts)) == 1
    else:  # skewed: the hottest expert holds far more than the average
        assert max(counts) > 2 * tokens // experts
    assert token_counts(tokens, experts, dist) == counts  # fixed seed


def test_unrounded_counts_and_bad_dist():
    counts = token_counts(1000, 7, "zipf", multiple=1)
    assert sum(counts) == 1000
    with pytest.raises(ValueError, match="dist"):
        token_counts(1000, 7, "gauss")


def test_table_lists_every_row_and_ratio():
    row = {"name": "dsv3-fc1", "dist": "uniform", "gwgrad_config": [128, 128],
           "methods": {"gwgrad": {"tflops": 685.0}, "torch_grouped_mm": {"tflops": 628.3},
                       "torch_mm_loop": {"tflops": 616.5}, "dense_cublas": {"tflops": 701.1}},
           "ratio_vs_torch_grouped_mm": 1.09, "ratio_vs_torch_mm_loop": 1.11,
           "ratio_vs_dense_cublas": 0.98}
    table = format_table([row])
    assert "dsv3-fc1" in table and "685.0" in table and "1.09" in table and "128x128" in table
