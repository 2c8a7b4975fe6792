"""Where the pages live: spec (shape and bytes), pool (slot ids), store (the tensors)."""
