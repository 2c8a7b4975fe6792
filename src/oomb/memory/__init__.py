"""Where the pages live: spec (shape and bytes), pool (slot ids), store (the tensors); a step's
memory (step: its sizes, the room measured for them, the check before it) and when its transfers
start (schedule)."""
