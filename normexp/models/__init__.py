"""The architectures and their parts: `norms` (every norm kind), `ffn` (the article's toy, whose
`Block` holds every placement) and `transformer` (a causal decoder whose sublayers are those Blocks)."""
