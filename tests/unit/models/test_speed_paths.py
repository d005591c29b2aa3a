"""The eager speed paths (issue 16) against plain formulations of the same math.

- the fused cross entropy vs `F.cross_entropy` on float32 copies of the logits,
- RoPE as one complex multiply vs the rotation written out with cos/sin in float64,
- keeping freed CPU memory: a step's large buffers come back without page faults.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchllm.loss as loss_mod
from torchllm.loss import IGNORE_INDEX, fused_cross_entropy_sum
from torchllm.models.llama.args import LlamaArgs
from torchllm.models.llama.model import apply_rope, rope_table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_equals_float32_cross_entropy(dtype, monkeypatch):
    """Values and gradients, with ignored targets and a chunk size that does not divide the
    rows (three rows per chunk here), in both logits dtypes."""
    vocab = 37
    monkeypatch.setattr(loss_mod, "_CHUNK_BYTES", 3 * 4 * vocab)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 8, vocab)).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (2, 8))
    targets[0, 2] = targets[1, 5] = targets[1, 7] = IGNORE_INDEX
    upstream = 0.37  # the trainer scales the summed loss by dp / tokens
    fused = loss_mod._FusedCrossEntropy.apply  # also for float32 logits (which take F's path)
    got = fused(logits.flatten(0, 1), targets.flatten())
    (got * upstream).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    (ref * upstream).backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, logits.grad, rtol=0, atol=1e-6 if dtype == torch.float32
                               else 1e-2)
    assert grad[0, 2].abs().max() == 0  # ignored rows get no gradient
    with torch.no_grad():  # validation: forward only
        torch.testing.assert_close(fused_cross_entropy_sum(logits, targets), ref.detach(),
                                   rtol=1e-6, atol=1e-5)
    # The entry point: bf16 logits past _PLAIN_MAX_BYTES take the chunked pass, smaller ones
    # and float32 logits the plain kernels.
    for limit in (0, 4 * logits.numel()):
        monkeypatch.setattr(loss_mod, "_PLAIN_MAX_BYTES", limit)
        out = fused_cross_entropy_sum(logits, targets)
        chunked = dtype == torch.bfloat16 and limit == 0
        assert ("_FusedCrossEntropy" in type(out.grad_fn).__name__) == chunked, out.grad_fn
        torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-5)


def rope_reference(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) by angles[..., i], written out in float64."""
    x = x.double()
    cos, sin = angles.double().cos()[..., None, :], angles.double().sin()[..., None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_written_out_rotation(dtype, compiled):
    """A shared table [seq, ...] and per-sequence positions [batch, seq, ...] (documents), with
    the gradient (the transposed rotation); eager (complex multiply) and compiled (reals; for
    bf16 with a backward of its own)."""
    args = LlamaArgs(dim=64, n_heads=4, max_seq_len=16)
    table = rope_table(args)
    angles = torch.atan2(table[..., 1], table[..., 0])  # [seq, head_dim/2]
    torch.manual_seed(0)
    positions = torch.stack([torch.arange(16), torch.tensor([0, 1, 2] + list(range(13)))])
    torch._dynamo.reset()
    rope = torch.compile(apply_rope, backend="aot_eager", fullgraph=True) if compiled \
        else apply_rope
    for tab, ang in ((table, angles[None]), (table[positions], angles[positions])):
        x = torch.randn(2, 16, 4, 16).to(dtype).requires_grad_()
        out = rope(x, tab)
        assert out.dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
        torch.testing.assert_close(out.double(), rope_reference(x, ang), **tol)
        g = torch.randn_like(out)
        out.backward(g)
        # d/dx of a rotation by +angle is the rotation by -angle of the upstream gradient.
        torch.testing.assert_close(x.grad.double(), rope_reference(g, -ang), **tol)


FAULTS = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, sys.argv[3])
    from conftest import tiny_args
    from torchllm.train import trainer_from_args
    keep = sys.argv[1]
    # A 32k vocab: each step's logits and their gradient are tens of MiB.
    trainer = trainer_from_args(tiny_args(sys.argv[2], "--model.vocab_size=32000",
        "--model.vocab_pad_multiple=1", "--training.seq_len=64", "--training.local_batch_size=8",
        "--metrics.log_freq=100", f"--training.cpu_keep_freed_memory={keep}"))
    faults = 0
    for step in range(1, 7):
        trainer.train_state.step = step
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        trainer.train_step()
        if step > 2:  # steady state: steps 3-6
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    trainer.close()
    print(faults)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keeping_freed_memory_removes_the_per_step_page_faults(tmp_path):
    """A training step with 32k-vocab logits (8 x 64 tokens: 62.5 MiB in float32): with the C
    library's defaults, the step's large buffers are mapped afresh and page-faulted in every
    step; with training.cpu_keep_freed_memory later steps reuse earlier steps' pages."""
    logits_pages = 8 * 64 * 32000 * 4 // 4096
    tests = str(Path(__file__).resolve().parents[2])

    def faults(keep: bool) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS, str(keep).lower(),
                              str(tmp_path / str(keep)), tests],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip().splitlines()[-1])

    # Steps 3-6 together: the defaults fault every buffer in every step; kept memory is reused
    # (glibc's aligned-block fragmentation can still cost an occasional buffer's worth).
    default, kept = faults(False), faults(True)
    assert default > 4 * logits_pages
    assert kept < 0.25 * default
