"""Pseudo-gradients between hosts: the collective, the exchange that encodes and sums them,
the dispatch thread that issues every collective, and the outer state's hash check."""
