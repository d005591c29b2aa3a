"""Training throughput: torchllm's Trainer vs a plain `transformers` Llama loop, same shapes.

    python benchmarks/bench_throughput.py [--shapes debug,small,125M] [--precisions fp32,bf16]
        [--modes eager,compiled] [--steps 4] [--rounds 3] [--vocab 32000] [--json OUT.json]
        [--md OUT.md]

For every (shape, precision, mode) both peers are built in this process, warmed up, then timed
in alternating rounds (torchllm then HF, then HF then torchllm, ...) so that both see the same
machine at the same moments. The median step time per peer over all rounds gives tokens/s and
MFU against this machine's matmul peak in the precision the run uses (measured here, best of
several trials). The ratio torchllm / HF is paired: each round's ratio of the two peers'
fastest step times (other processes only ever slow a step down: a round's fastest step is
the one least disturbed), their geometric mean over the rounds, and a 95% interval for it
(Student's t on the logarithms; none from a single round): a row's ratio is only as sure as
that interval. Both peers see the same random-token batches and do the same work per step:
forward, float32 cross-entropy, backward, gradient clipping at 1.0, fused AdamW.

- torchllm: the real Trainer (`train_step`, metrics and guard included) with synthetic batches
  in place of its data loader; compiled = `compile.enable` (each block + the loss).
- HF: `LlamaForCausalLM` (SDPA attention) with the same config (via the HF export adapter),
  called with use_cache=False (else every training forward also fills a KV cache, and the
  compiled layers recompile on the cache's state until dynamo's limit sends them to eager);
  bf16 = autocast around the forward; compiled = `torch.compile` of each decoder layer.
Shapes: debug (dim 256 x 4, seq 256), small (dim 512 x 6, seq 512), 125M (dim 768 x 12, seq 256);
vocab 32,000 for all by default (a Llama-2/Mistral-sized vocab; --vocab sets another).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchllm.models.llama.hf import LlamaAdapter
from torchllm.metrics.flops import Peak
from torchllm.precision import cpuinfo
from torchllm.train import trainer_from_args

# name -> (flavor, seq_len, local batch)
SHAPES = {"debug": ("debug", 256, 8), "small": ("small", 512, 4), "125M": ("125M", 256, 4)}
VOCAB = 32000


def batches(vocab: int, batch: int, seq: int, n: int = 4, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()})
    return out


class TorchllmPeer:
    name = "torchllm"

    def __init__(self, shape: str, bf16: bool, compiled: bool, folder: Path, vocab: int):
        flavor, seq, batch = SHAPES[shape]
        self.trainer = trainer_from_args([
            f"--job.dump_folder={folder}", "--job.print_config=false", f"--model.flavor={flavor}",
            f"--model.vocab_size={vocab}", "--model.vocab_pad_multiple=1",
            f"--training.seq_len={seq}", f"--training.local_batch_size={batch}",
            "--training.steps=1000000", "--metrics.log_freq=1000000",
            "--metrics.enable_tensorboard=false", "--validation.enable=false",
            "--checkpoint.enable=false", "--training.device=cpu",
            f"--training.mixed_precision={'bf16' if bf16 else 'none'}",
            f"--compile.enable={'true' if compiled else 'false'}",
            "--data.tokenizer_vocab_size=2048",
        ])
        if self.trainer is None:
            raise SystemExit("torchllm config error (see above)")
        data = batches(vocab, batch, seq)
        from torchllm.data.loader import CountedBatches  # each batch counts its tokens, as the loader's

        self.trainer.batches = CountedBatches(iter(data * 1000000), packed_chat=False)
        self.tokens = batch * seq
        self.flops_per_token = self.trainer.flops_per_token
        self.args = self.trainer.model_args

    def step(self) -> None:
        self.trainer.train_state.step += 1
        self.trainer.train_step()


class HFPeer:
    name = "hf"

    def __init__(self, args, shape: str, bf16: bool, compiled: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        _, seq, batch = SHAPES[shape]
        config = LlamaConfig(**LlamaAdapter.config(args, args.vocab_size))
        torch.manual_seed(0)
        self.model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
        self.model.train()
        if compiled:
            for layer in self.model.model.layers:
                layer.compile()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1,
                                     fused=True)
        self.bf16 = bf16
        self.data = batches(args.vocab_size, batch, seq)
        self.i = 0
        self.tokens = batch * seq

    def step(self) -> None:
        b = self.data[self.i % len(self.data)]
        self.i += 1
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else _null()
        with ctx:
            logits = self.model(input_ids=b["inputs"], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# Student's t 97.5% quantiles by degrees of freedom (the 95% two-sided interval); between the
# listed ones the next smaller's (a slightly wider, conservative interval).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def paired_ratio(ratios: list[float]) -> tuple[float, tuple[float, float] | None]:
    """Geometric mean of per-round ratios and its 95% interval (None from one round)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    df = len(logs) - 1
    t = _T975[max(k for k in _T975 if k <= df)]
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), (math.exp(mean - half), math.exp(mean + half))


def timed(peer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        peer.step()
        out.append(time.perf_counter() - t0)
    return out


def run_pair(shape: str, precision: str, mode: str, steps: int, rounds: int, warmup: int,
             vocab: int = VOCAB) -> dict:
    bf16, compiled = precision == "bf16", mode == "compiled"
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ours = TorchllmPeer(shape, bf16, compiled, Path(tmp), vocab)
        hf = HFPeer(ours.args, shape, bf16, compiled)
        for peer in (ours, hf):  # warm-up: compile, optimizer state, allocator
            timed(peer, warmup)
        setup_s = time.perf_counter() - t0
        times = {ours.name: [], hf.name: []}
        round_ratios = []
        for r in range(rounds):
            this_round = {}
            for peer in ((ours, hf) if r % 2 == 0 else (hf, ours)):  # who goes first alternates
                this_round[peer.name] = timed(peer, steps)
                times[peer.name] += this_round[peer.name]
            round_ratios.append(min(this_round[hf.name]) / min(this_round[ours.name]))
        peak = Peak(torch.device("cpu"), bf16)
        row = {"shape": shape, "precision": precision, "mode": mode, "vocab": vocab,
               "steps_timed": steps * rounds,
               "tokens_per_step": ours.tokens, "flops_per_token": ours.flops_per_token,
               "setup_s": setup_s}
        tok_s = {name: ours.tokens / statistics.median(ts) for name, ts in times.items()}
        # One peak for both peers: re-measured (and at least what either reached) if exceeded.
        row["peak_flops"] = peak.check(max(tok_s.values()) * ours.flops_per_token)
        for name, value in tok_s.items():
            row[f"{name}_tok_s"] = value
            row[f"{name}_mfu_pct"] = 100 * value * ours.flops_per_token / row["peak_flops"]
        row["round_ratios"] = round_ratios
        row["ratio"], row["ratio_ci95"] = paired_ratio(round_ratios)
        del ours, hf
        gc.collect()
    return row


def markdown(rows: list[dict], peaks: dict[str, float], threads: int) -> str:
    """The results table; the last column is against this CPU's matmul limit: the peak of its
    faster dtype (bf16 where it is native, else fp32: CPUs differ)."""
    limit_dtype = max(peaks, key=peaks.get)
    limit = peaks[limit_dtype]
    lines = [f"CPU, {threads} threads; matmul peaks (measured, best of trials) "
             + ", ".join(f"{p} {f / 1e9:.0f} GFLOP/s" for p, f in peaks.items())
             + f": the limit is {limit_dtype}'s. MFU = model FLOPs (6N + attention) / peak of "
             "the precision used.", "",
             "| shape | precision | mode | torchllm tok/s | HF tok/s | torchllm / HF | "
             f"95% interval | torchllm MFU % | HF MFU % | % of the {limit_dtype} limit "
             "(torchllm) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        of_limit = 100 * r["torchllm_tok_s"] * r["flops_per_token"] / limit
        ci = r.get("ratio_ci95")
        interval = f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-"
        lines.append(
            f"| {r['shape']} | {r['precision']} | {r['mode']} | {r['torchllm_tok_s']:,.0f} | "
            f"{r['hf_tok_s']:,.0f} | {r['ratio']:.3f}x | {interval} | "
            f"{r['torchllm_mfu_pct']:.1f} | "
            f"{r['hf_mfu_pct']:.1f} | {of_limit:.1f} |")
    best = {}
    for r in rows:
        key = (r["shape"], r["precision"])
        best.setdefault(key, {})[r["mode"]] = r["torchllm_tok_s"]
    speedups = [f"{s} {p}: {m['compiled'] / m['eager']:.2f}x" for (s, p), m in best.items()
                if {"eager", "compiled"} <= set(m)]
    if speedups:
        lines += ["", "torchllm compiled / eager: " + ", ".join(speedups)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="debug,small,125M")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--steps", type=int, default=4, help="timed steps per peer per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size of every shape")
    p.add_argument("--json", default="")
    p.add_argument("--md", default="")
    args = p.parse_args(argv)
    for name, allowed in (("shapes", SHAPES), ("precisions", ("fp32", "bf16")),
                          ("modes", ("eager", "compiled"))):
        bad = set(getattr(args, name).split(",")) - set(allowed)
        if bad:
            p.error(f"--{name}: unknown {sorted(bad)}; allowed: {', '.join(allowed)}")
    rows = []
    for shape in args.shapes.split(","):
        for precision in args.precisions.split(","):
            for mode in args.modes.split(","):
                row = run_pair(shape, precision, mode, args.steps, args.rounds, args.warmup,
                               args.vocab)
                rows.append(row)
                print(f"{shape:6s} {precision:5s} {mode:8s} torchllm {row['torchllm_tok_s']:8,.0f} "
                      f"tok/s | HF {row['hf_tok_s']:8,.0f} tok/s | {row['ratio']:.3f}x | MFU "
                      f"{row['torchllm_mfu_pct']:.1f}% vs {row['hf_mfu_pct']:.1f}%", flush=True)
    # Each dtype's peak: measured now, and no lower than any row's (a row's peak is raised to
    # what its steps reached when the machine was busy during its measurement).
    peaks = {}
    for precision in ("fp32", "bf16"):
        measured = Peak(torch.device("cpu"), precision == "bf16").flops
        peaks[precision] = max([measured] + [r["peak_flops"] for r in rows
                                             if r["precision"] == precision])
    table = markdown(rows, peaks, torch.get_num_threads())
    print(table)
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "cpu": cpuinfo("model name") or "unknown CPU", "peak_flops": peaks, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        Path(args.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
