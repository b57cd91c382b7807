"""Quality of a cache: streaming perplexity (ppl), sweeps over memory targets (sweep), the confidence probe,
the degradation guard, INT8 against full precision, the endless stream under a byte cap, the streaming
cross-check, the every-policy table at one memory, the soak."""
