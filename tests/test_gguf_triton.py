"""The Triton GGUF kernels (kernels/gguf_triton.py) against gguf.quants.dequantize and a float64 matmul.

On CPU under the Triton interpreter (as tests/test_kernels_triton.py runs its kernels), and compiled on a
CUDA device (@pytest.mark.gpu). The kernels dequantize exactly (gguf.quants' float32 arithmetic) and do
not quantize activations: the matmul is within (K + 8) * 2^-23 * sum |x w| of the float64 product (float32
sums in another order) plus, on a GPU, the rounding of its bf16 / fp16 operands and output.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest_kernels import request_triton_interpreter, run_interpreted

request_triton_interpreter()

from pdserve.kernels._triton import HAS_TRITON, INTERPRETED  # noqa: E402
from pdserve.kernels.gguf_formats import TYPES, GGUFMatrix, Segment, dequantize_reference  # noqa: E402
from pdserve.kernels.gguf_triton import gguf_gather_triton, gguf_linear_triton  # noqa: E402
from tests.gguf_models import Q, random_blocks  # noqa: E402

NO_CUDA = not torch.cuda.is_available()
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
interpreted = pytest.mark.skipif(not (HAS_TRITON and NO_CUDA and INTERPRETED),
                                 reason="needs triton under TRITON_INTERPRET=1 and no CUDA device")


@pytest.mark.skipif(not HAS_TRITON or not NO_CUDA or INTERPRETED, reason="the cases run in this process")
def test_cases_in_fresh_process():
    run_interpreted(__file__)


def matrix_of(kinds: tuple[str, ...], rows: int, cols: int, device: str = "cpu") -> GGUFMatrix:
    segments = tuple(Segment(kind, torch.from_numpy(random_blocks(Q[kind], rows + i, cols, seed=i)).to(device))
                     for i, kind in enumerate(kinds))
    return GGUFMatrix(segments, cols)


def check(y: torch.Tensor, x: torch.Tensor, matrix: GGUFMatrix, operand_rounding: float) -> None:
    w = dequantize_reference(matrix).double()
    xs = x.cpu().double()
    expected = xs @ w.T
    magnitude = xs.abs() @ w.abs().T
    bound = ((matrix.in_features + 8) * 2.0 ** -23 + operand_rounding) * magnitude + operand_rounding * expected.abs()
    assert not y.isnan().any()
    excess = (y.cpu().double() - expected).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"


@interpreted
@pytest.mark.parametrize("kind", QUANTIZED)
def test_every_type_against_gguf_dequantize_and_a_float64_matmul(kind):
    cols = TYPES[kind].block * 3 if TYPES[kind].block == 256 else 96
    for batch in (1, 5, 17):
        matrix = matrix_of((kind,), rows=37, cols=cols)
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
        check(gguf_linear_triton(x, matrix), x, matrix, operand_rounding=0.0)


@interpreted
def test_a_fused_projection_of_three_types():
    matrix = matrix_of(("Q4_K", "Q6_K", "Q8_0"), rows=9, cols=256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    check(gguf_linear_triton(x, matrix, block_n=16), x, matrix, operand_rounding=0.0)


@interpreted
@pytest.mark.parametrize("kind", ["Q5_0", "Q6_K", "IQ4_XS"])
def test_gathered_rows_are_gguf_dequantized_rows(kind):
    matrix = matrix_of((kind,), rows=11, cols=TYPES[kind].block * 2 if TYPES[kind].block == 256 else 160)
    ids = torch.tensor([[10, 0], [3, 3]])
    out = gguf_gather_triton(matrix.segments[0], ids, torch.float32, chunk=128)
    assert out.shape == (2, 2, matrix.in_features)
    assert torch.equal(out, dequantize_reference(matrix)[ids])


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA or not HAS_TRITON, reason="needs a CUDA device and triton")
@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_kernels_on_the_gpu(kind, dtype):
    cols = TYPES[kind].block * 4 if TYPES[kind].block == 256 else 1024
    matrix = matrix_of((kind, "Q8_0"), rows=300, cols=cols, device="cuda")
    x = torch.randn(33, cols, generator=torch.Generator().manual_seed(0)).to(dtype)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    check(gguf_linear_triton(x.cuda(), matrix), x, matrix.to("cpu"), operand_rounding=rounding)
    ids = torch.tensor([5, 0, 299], device="cuda")
    gathered = gguf_gather_triton(matrix.segments[0], ids, torch.float32).cpu()
    expected = dequantize_reference(matrix.to("cpu"))[ids.cpu()]
    torch.testing.assert_close(gathered, expected, rtol=0, atol=2.0 ** -22 * expected.abs().max().item())  # fused
