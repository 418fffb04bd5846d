"""The training engines: `reference` (the one training loop, which defines a run), `batched` (runs
stacked, bit for bit the reference's) and `fast` (torch.func over the model's own modules, close to
the reference within the reference's own noise)."""
