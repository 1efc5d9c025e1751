"""Which kernel and split each call gets: the heuristic, the measured tuning tables
(``configs/<gpu>.json``) and the cached launch plans."""
