"""One adapter per outside format, each turning it into record batches."""
