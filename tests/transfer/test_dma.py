"""kvtier/transfer/dma.py: the CUDA runtime's copies by address (real GPU; CPU: absent)."""

from __future__ import annotations

import pytest
import torch

from kvtier.transfer import dma


def test_no_runtime_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert dma.runtime() is None


@pytest.mark.cuda
def test_copies_by_address_are_exact_each_way() -> None:
    rt = dma.runtime()
    assert rt is not None, "CUDA is present but its runtime library was not found"
    stream = torch.cuda.Stream()
    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    rt.copy(dev.data_ptr() + 4096, host.data_ptr() + 8192, 65536, stream)
    back = torch.zeros(65536, dtype=torch.uint8).pin_memory()
    rt.copy(back.data_ptr(), dev.data_ptr() + 4096, 65536, stream)
    stream.synchronize()
    assert torch.equal(back, host[8192 : 8192 + 65536])
    assert int(dev[:4096].count_nonzero()) == 0  # nothing outside the range


@pytest.mark.cuda
def test_copy_2d_places_each_row_at_its_pitch() -> None:
    rt = dma.runtime()
    assert rt is not None
    stream = torch.cuda.Stream()
    rows, width, src_pitch, dst_pitch = 6, 3000, 4096, 10000
    host = torch.randint(0, 256, (rows * src_pitch,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(rows * dst_pitch, dtype=torch.uint8, device="cuda")
    rt.copy_2d(dev.data_ptr(), dst_pitch, host.data_ptr(), src_pitch, width, rows, stream)
    stream.synchronize()
    got, want = dev.cpu().view(rows, dst_pitch), host.view(rows, src_pitch)
    assert torch.equal(got[:, :width], want[:, :width])
    assert int(got[:, width:].count_nonzero()) == 0


@pytest.mark.cuda
def test_a_bad_copy_raises_naming_the_call() -> None:
    rt = dma.runtime()
    assert rt is not None
    dev = torch.zeros(16, dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError, match="cudaMemcpy2DAsync"):  # width beyond the pitch
        rt.copy_2d(dev.data_ptr(), 4, dev.data_ptr(), 4, 8, 2, torch.cuda.current_stream())
    # The error is not left behind for torch's next launch check to report as its own.
    assert int((dev + 1).sum()) == 16
    torch.cuda.synchronize()
