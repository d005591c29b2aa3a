"""Packings: how a source's rows become windows (text windows, or conversations with an
assistant-only loss mask), chosen by the data.dataset value (config.job_config.data_packing)."""
