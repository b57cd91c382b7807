"""Evaluation: streaming perplexity, needle retrieval, the confidence probe, sweeps, reports."""
