"""Live path: aggregate record batches into counters and histograms, and serve them."""
