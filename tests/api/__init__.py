"""The Checkpointer's public behaviour in one process and across ranks: round trips, affordances, one_rank_acts."""
