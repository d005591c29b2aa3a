"""A mixture is a source of sources: `[[data.sources]]` (dataset + weight), each entry parsed as
its own kind, read through torchllm.data.mixture.MixtureBatches (the schedule, epochs, resume)."""

from __future__ import annotations

from torchllm.config.job_config import ConfigError
from torchllm.data.kinds.base import Context, DataKind
from torchllm.data.kinds.registry import parse_source
from torchllm.data.mixture import MixtureBatches, normalized_weights, source_config, source_seed


def _in_source(error: ConfigError, dcfg, i: int) -> ConfigError:
    """`error` of source i, prefixed with which source it is (once)."""
    where = f"data.sources[{i}] ({dcfg.sources[i].dataset})"
    said = str(error) if str(error).startswith(f"{where}:") else f"{where}: {error}"
    return ConfigError(said, error.key or "data.sources")


class Mixture(DataKind):
    def __init__(self, dcfg, parts: list[DataKind]):
        super().__init__(dcfg, "")
        self.parts, self.weights = parts, normalized_weights(dcfg.sources)
        self.chat = any(p.chat for p in parts)

    @classmethod
    def parse(cls, dcfg, location: str = "") -> "Mixture":
        normalized_weights(dcfg.sources)  # every entry has a dataset and a weight > 0
        parts = []
        for i in range(len(dcfg.sources)):
            try:
                parts.append(parse_source(source_config(dcfg, i)))
            except ConfigError as e:
                raise _in_source(e, dcfg, i) from None
        return cls(dcfg, parts)

    def preflight(self) -> None:
        for i, part in enumerate(self.parts):
            try:
                part.preflight()
            except ConfigError as e:
                raise _in_source(e, self.dcfg, i) from None

    def tokenizer_source(self) -> DataKind:
        return self.parts[0]  # 'auto' trains on (or, for shards, loads the tokenizer of) the first

    def texts(self):
        return self.parts[0].texts()

    def windows(self, ctx: Context):
        raise ConfigError("a mixture cannot be a source of another mixture", "data.sources")

    def batches(self, ctx: Context):
        """(MixtureBatches, validation windows): each source's own held-out split, one after
        the other."""
        import torch

        sources, vals = [], []
        for i, part in enumerate(self.parts):
            # Each source its own seed, so equal sources still read in different orders.
            one = Context(ctx.job_config, ctx.tokenizer, ctx.dp_rank, ctx.dp_degree,
                          source_seed(ctx.seed, i))
            try:
                source, val = part.windows(one)
            except ConfigError as e:
                raise _in_source(e, self.dcfg, i) from None
            sources.append(source)
            vals.append(val)
        train = MixtureBatches(sources, [s.dataset for s in self.dcfg.sources], self.weights,
                               ctx.batch_size, ctx.dp_rank, ctx.dp_degree)
        return train, torch.utils.data.ConcatDataset(vals)

    def whole_stream(self, tokenizer, max_tokens: int):
        raise ConfigError("a mixture cannot be read whole", "validation.dataset")
