"""Training engines that are not the reference loop: `fast` (torch.func, optional compile)."""
