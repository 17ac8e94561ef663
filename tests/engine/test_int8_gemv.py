"""The one-row int8 kernel: the exact int8 sums at any shape, used by int8 layers at one row only, and
its fallback to fbgemm where it cannot be built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from serve_app.model.kernels.int8_gemv import Int8Gemv, RowWeights, load_int8_gemv
from serve_app.model.quant.quantize import WEIGHT_MAX, Int8Linear


@pytest.fixture(scope="module")
def gemv(tmp_path_factory: pytest.TempPathFactory) -> Int8Gemv:
    kernel = load_int8_gemv(tmp_path_factory.mktemp("kernels"))
    assert kernel is not None
    return kernel


def _int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` quantized as `Int8Linear` quantizes it: int8, one scale per output channel."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-8) / WEIGHT_MAX
    return torch.round(weight / scale[:, None]).clamp(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8), scale


def _exact_product(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The row quantized at its own scale (its largest magnitude / 127) times the int8 weight, exact in float64."""
    row_scale = row.abs().max().double() / 127
    sums = torch.round(row.double() / row_scale) @ weight.double().T
    return (sums * row_scale * scale.double()).float()


# Widths with and without a 64-byte tail, and output counts with and without a block of four left over.
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 192), (64, 4), (100, 7), (1536, 33), (9000, 5)])
def test_the_kernel_computes_the_int8_sums_of_the_row_quantized_at_its_own_scale(
    gemv: Int8Gemv, in_features: int, out_features: int
) -> None:
    torch.manual_seed(in_features + out_features)
    weight, scale = _int8_weight(torch.randn(out_features, in_features))
    row = torch.randn(1, in_features) * 3
    row[0, 0] = -40.0  # the row's largest magnitude sets its scale, negative or not
    got = gemv(row, RowWeights.of(weight, scale))
    assert got.shape == (1, out_features)
    torch.testing.assert_close(got, _exact_product(row, weight, scale), rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_only_a_float32_row_of_its_width(gemv: Int8Gemv) -> None:
    weights = RowWeights.of(*_int8_weight(torch.randn(8, 16)))
    for bad in (torch.zeros(2, 16), torch.zeros(1, 15), torch.zeros(1, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match="int8 gemv"):
            gemv(bad, weights)


def test_an_int8_layer_runs_the_kernel_at_one_row_and_fbgemm_at_more(gemv: Int8Gemv) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48)
    layer, fbgemm_only = Int8Linear(linear, gemv), Int8Linear(linear)
    weight, scale = _int8_weight(linear.weight.detach())
    rows = torch.randn(3, 128)
    with torch.inference_mode():
        expected = linear(rows)
        for row in rows.split(1):
            got = layer(row)
            torch.testing.assert_close(got, _exact_product(row, weight, scale) + linear.bias, rtol=1e-5, atol=1e-5)
            # fbgemm quantizes the row asymmetrically (uint8 and a zero point), so its product differs a little.
            assert not torch.equal(got, fbgemm_only(row))
            assert float((got - linear(row)).abs().max() / linear(row).abs().max()) < 0.05
        torch.testing.assert_close(layer(rows), fbgemm_only(rows), rtol=0, atol=0)  # several rows: fbgemm
        assert float(((layer(rows) - expected).abs().amax(dim=1) / expected.abs().amax(dim=1)).max()) < 0.05


def test_without_a_compiler_every_step_runs_fbgemm(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="serve_app.model.kernels.int8_gemv"):
        assert load_int8_gemv(tmp_path) is None
    assert "fbgemm at one row too" in caplog.text and "no C compiler" in caplog.text
