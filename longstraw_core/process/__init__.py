"""One process of a run, whatever it trains: how it ends on an error, where faults are
injected, its progress bar, its threads, the non-finite guard."""
