import numpy as np
import pytest

from vqpipe.codec.codebook import boundaries, codebook, gaussian_pdf, lloyd_max, sphere_pdf

# Max (1960) / Lloyd (1982): minimum MSE of an N-level quantizer for a unit Gaussian.
CLASSICAL_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_matches_classical_lloyd_max(bits):
    levels, mse = lloyd_max(gaussian_pdf, 1 << bits, 10.0)
    assert float(f"{mse:.3g}") == float(f"{CLASSICAL_MSE[bits]:.3g}")
    assert np.allclose(levels, -levels[::-1], atol=1e-6)  # symmetric density -> symmetric levels


def test_sphere_codebook_tends_to_gaussian_and_differs_for_small_dims():
    g, _ = lloyd_max(gaussian_pdf, 16, 10.0)
    assert np.allclose(codebook(4, 11008), g, atol=1e-2)
    assert np.abs(codebook(4, 50) - g).max() > 0.02  # lighter tails at d = 50
    # The fitted codebook beats the Gaussian one on its own density.
    pdf = sphere_pdf(50)
    t = np.linspace(-np.sqrt(50), np.sqrt(50), 200001)
    w = pdf(t) / pdf(t).sum()

    def mse(levels):
        q = levels[np.searchsorted(boundaries(levels), t)]
        return np.sum(w * (t - q) ** 2)

    assert mse(codebook(4, 50)) < mse(g)


def test_memoised_and_read_only():
    assert codebook(3, 896) is codebook(3, 896)
    with pytest.raises(ValueError):
        codebook(3, 896)[0] = 1.0


@pytest.mark.parametrize("bits", [0, 1, 7, 9, "4"])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="unsupported bits"):
        codebook(bits, 64)
