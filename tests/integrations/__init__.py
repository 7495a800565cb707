"""Framework integrations against the real wheels, and interop with DCP and torch.save."""
