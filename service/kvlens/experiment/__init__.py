"""The articles' experiments against an endpoint: trace -> token prompts, an open-loop client,
arms (off / cold / warm), the protocol; records out, handed to ``analysis/compare``."""
