"""What every benchmark shares: the description of the machine it ran on
(:mod:`.machine`), one percentile and exact Student-t bounds (:mod:`.stats`), the
writer of its JSON result (:mod:`.results`), and how a run of the engine benchmark
is read back (:mod:`.engine_runs`)."""
