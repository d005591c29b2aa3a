"""A toy data source, written as docs/howto_data_source.md says: data.dataset = "counting:N" is N
documents "count 0: 0", "count 1: 0 1", ... generated in memory
(tests/unit/data/test_data_howto.py)."""

from __future__ import annotations

from torchllm.config.job_config import ConfigError
from torchllm.data.sources.base import CorpusSource
from torchllm.data.sources.registry import register


def counting_documents(n: int) -> list[str]:
    return [f"count {i}: " + " ".join(str(k) for k in range(i + 1)) for i in range(n)]


@register
class Counting(CorpusSource):
    prefix = "counting"  # data.dataset = "counting:N"
    usage, order = "counting:N", 9

    @classmethod
    def parse(cls, dcfg, location: str) -> "Counting":
        source = super().parse(dcfg, location)  # an empty location: "give a location ..."
        if not location.isdigit() or int(location) < 1:
            raise ConfigError(f"data.dataset = {dcfg.dataset!r}: N must be a whole number >= 1",
                              "data.dataset")
        return source

    def texts(self):
        return iter(counting_documents(int(self.location)))
