"""quant.runtime.hadamard: the block Walsh-Hadamard rotation against its dense definition."""

from __future__ import annotations

import pytest
import torch

from quant.runtime import hadamard

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("k,block", [(1536, 512), (576, 64), (14336, 2048), (128, 128), (8192, 4096)])
def test_block_size_is_the_largest_power_of_two_dividing(k, block):
    assert hadamard.block_size(k) == block


@pytest.mark.parametrize("k", [1536, 14336, 96])
def test_rotate_matches_the_dense_block_diagonal_product(k):
    block = hadamard.block_size(k)
    x = torch.randn(3, 5, k, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = hadamard.rotate(x, block)
    assert y.shape == x.shape
    torch.testing.assert_close(y, hadamard.rotate_reference(x, block), rtol=1e-12, atol=1e-12)
    # CUDA's form (two small products per block), held to the same definition here
    torch.testing.assert_close(hadamard.kronecker(x, block), y, rtol=1e-12, atol=1e-12)
    # orthonormal and symmetric: norms kept, and applying it twice is the identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard.rotate(y, block), x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_op_and_the_pytorch_butterfly_agree_bit_for_bit(dtype):
    """The C++ op (which the W8A8 rows pass shares) and the PyTorch butterfly make the same sums in the same order."""
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(hadamard.rotate(x, 512), hadamard.butterfly(x, 512))


def test_weight_rotation_keeps_the_function():
    """y = W x = (W H^T)(H x): the weight's rows are rotated by the same transform (H is symmetric)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(24, 256, generator=g, dtype=torch.float64), torch.randn(7, 256, generator=g, dtype=torch.float64)
    torch.testing.assert_close(hadamard.rotate(x, 64) @ hadamard.rotate(w, 64).t(), x @ w.t())


def test_sylvester_is_hadamard():
    h = hadamard.sylvester(16)
    torch.testing.assert_close(h @ h.t(), 16 * torch.eye(16))
    with pytest.raises(ValueError, match="power of two"):
        hadamard.sylvester(12)


def test_rotate_refuses_a_block_that_does_not_tile():
    with pytest.raises(ValueError, match="cannot rotate 96 channels in blocks of 64"):
        hadamard.rotate(torch.zeros(2, 96), 64)
